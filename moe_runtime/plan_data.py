"""What the memory plan knows of the traffic: sequence lengths and expert routing.

KV blocks buy admitted sequences at the traffic's lengths (prompt plus output tokens); expert
slots buy hits along the routing's curve (:mod:`moe_runtime.hit_curve`). Without data the plan
uses :data:`AZURE_CONVERSATION` and the default routing; given files (``--plan-data``; the server
also passes its own ``--record-trace`` and ``--eamc-path`` files when they exist), it reads them:

- a trace file (``moeserve-trace/1``, docs/trace-format.md): each request's length
  (``prompt_len`` plus its generated tokens) and its EAM (the decode tokens' choices, or all its
  tokens when it has none), the first :data:`MAX_RECORDS` requests;
- an EAMC file (``tracer.eamc``): its entries' EAMs (no lengths).

The product does not read ``../shared/data`` at run time: the Azure figures are baked in here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe_runtime.errors import ConfigError
from moe_runtime.hit_curve import RoutingModel, default_routing, routing_from_eams

#: Requests read from one trace file (enough for the quantiles and the routing profiles).
MAX_RECORDS = 1000
#: The quantiles a :class:`LengthDistribution` keeps.
QUANTILES = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)


@dataclass(frozen=True)
class LengthDistribution:
    """Tokens per request (prompt plus output), as quantiles; piecewise linear between them.

    Attributes:
        points: ``(quantile, tokens)`` pairs, quantiles ascending from 0 to 1.
        source: where they come from, for the load summary.
    """

    points: tuple[tuple[float, int], ...]
    source: str

    def quantile(self, q: float, max_len: int | None = None) -> int:
        """Tokens at quantile ``q``, at most ``max_len`` (longer requests are refused)."""
        qs, ts = zip(*self.points, strict=True)
        value = int(round(float(np.interp(q, qs, ts))))
        return max(1, min(value, max_len) if max_len else value)

    def mean(self, max_len: int | None = None) -> float:
        """Mean tokens per request with lengths capped at ``max_len`` (the quantile function
        integrated over 1,001 points)."""
        qs, ts = zip(*self.points, strict=True)
        grid = np.linspace(0.0, 1.0, 1001)
        values = np.interp(grid, qs, ts)
        if max_len:
            values = np.minimum(values, max_len)
        return float(np.trapezoid(values, grid))

    @classmethod
    def from_lengths(cls, lengths: list[int], source: str) -> LengthDistribution:
        """The quantiles :data:`QUANTILES` of observed ``lengths`` (numpy's linear quantiles)."""
        values = np.quantile(np.asarray(lengths, dtype=np.float64), QUANTILES)
        return cls(tuple((q, int(round(v))) for q, v in zip(QUANTILES, values, strict=True)), source)


#: Prompt plus output tokens of the Azure LLM inference trace 2023, conversation service
#: (Splitwise, Patel et al., ISCA 2024; Azure/AzurePublicDataset ``AzureLLMInferenceTrace_conv.csv``,
#: CC-BY 4.0): 19,366 requests, ``ContextTokens + GeneratedTokens``, numpy linear quantiles; mean
#: 1,366, p50 1,412, p90 2,820.
AZURE_CONVERSATION = LengthDistribution(
    (
        (0.0, 64), (0.05, 296), (0.1, 368), (0.2, 473), (0.3, 506), (0.4, 800), (0.5, 1412),
        (0.6, 1469), (0.7, 1522), (0.8, 1628), (0.9, 2820), (0.95, 4136), (0.99, 4259), (1.0, 14089),
    ),
    "Azure LLM trace 2023, conversations",
)  # fmt: skip


@dataclass(frozen=True)
class PlanData:
    """The traffic the plan sizes for: ``lengths`` and ``routing`` (defaults where no file gave
    them)."""

    lengths: LengthDistribution
    routing: RoutingModel


def read_plan_data(paths: tuple[str, ...], num_layers: int, num_experts: int, top_k: int) -> PlanData:
    """Lengths and routing from ``paths`` (trace or EAMC files, told apart by their first bytes:
    an EAMC is a zip archive), the defaults for what none of them gives.

    Raises:
        ConfigError: a file that cannot be read, or of another model's layers and experts (one
            line naming the file).
    """
    lengths: list[int] = []
    eams: list[np.ndarray] = []
    names: list[str] = []
    for raw in paths:
        path = Path(raw)
        try:
            with path.open("rb") as f:
                zipped = f.read(4) == b"PK\x03\x04"
            got = _read_eamc(path) if zipped else _read_trace(path, lengths)
        except (OSError, ValueError) as exc:  # TracerError is a ValueError
            raise ConfigError(
                f"--plan-data {path}: {str(exc).splitlines()[0] if str(exc) else exc}"
            ) from None
        if got.shape[1:] != (num_layers, num_experts):
            raise ConfigError(
                f"--plan-data {path}: its EAMs are {got.shape[1]} layers x {got.shape[2]} experts, "
                f"the model has {num_layers} x {num_experts}"
            )
        eams.append(got)
        names.append(path.name)
    found = np.concatenate(eams) if eams else np.zeros((0, num_layers, num_experts))
    routing = default_routing(num_layers, num_experts, top_k)
    if len(found) and found.sum() > 0:
        routing = routing_from_eams(found, top_k, f"{len(found)} recorded requests ({', '.join(names)})")
    dist = AZURE_CONVERSATION
    if lengths:
        dist = LengthDistribution.from_lengths(lengths, f"{len(lengths)} recorded requests")
    return PlanData(dist, routing)


def _read_trace(path: Path, lengths: list[int]) -> np.ndarray:
    """The first :data:`MAX_RECORDS` requests' EAMs ``(R, L, E)``; their lengths appended to
    ``lengths``."""
    from tracer.trace_file import iter_traces

    eams = []
    for i, rec in enumerate(iter_traces(path)):
        if i == MAX_RECORDS:
            break
        generated = rec.num_tokens - rec.num_prefill
        prompt = rec.prompt_len if rec.prompt_len is not None else rec.num_prefill
        lengths.append(prompt + generated)
        eams.append(rec.eam(prefill=False) if generated else rec.eam())
    if not eams:
        raise ValueError("the trace file holds no request")
    return np.stack(eams).astype(np.float64)


def _read_eamc(path: Path) -> np.ndarray:
    """An EAMC file's entries ``(n, L, E)``."""
    from tracer.eamc import EAMC

    return np.array(EAMC.load(path).entries(), dtype=np.float64)
