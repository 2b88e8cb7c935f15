"""The engine: add requests, step, stream outputs (vLLM's ``LLMEngine`` shape, MoE-offloading inside).

``step()`` is schedule -> execute -> update. It is not thread-safe: one engine thread owns it (the
server's engine client forwards requests to that thread). Its parts live beside it by concern:
request admission (``admission.py``), the step's outputs and finishing (``outputs.py``), prompt
scoring (``scoring.py``), the paged KV cache it builds (``kv_setup.py``) and the expert trace of
cached and recomputed blocks (``prefix_eam.py``).

Failure isolation: an exception while scheduling or in the forward pass is a runtime (device)
fault and propagates out of ``step()``: the engine is then unusable. An exception in one request's
post-processing finishes only that request (``outputs.py``).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moe_runtime.buffer import ExpertBuffer
from moe_runtime.config import RuntimeConfig
from moe_runtime.device import device_scope
from moe_runtime.engine import context as step_context
from moe_runtime.engine.admission import RequestAdmission
from moe_runtime.engine.compiled_decode import CompiledDecode
from moe_runtime.engine.context import StepContext
from moe_runtime.engine.decode_graphs import DecodeGraphs, capture_at_start
from moe_runtime.engine.kv_setup import build_kv
from moe_runtime.engine.outputs import StepOutputs
from moe_runtime.engine.prefix_eam import StepRecorder
from moe_runtime.engine.request import RequestOutput, SamplingParams, Sequence
from moe_runtime.engine.sampler import sample
from moe_runtime.engine.scheduler import ScheduledSeq, Scheduler
from moe_runtime.engine.scoring import PromptScoring
from moe_runtime.engine.structured import GrammarMatcher
from moe_runtime.errors import ConfigError
from moe_runtime.host_alloc import keep_freed_memory
from moe_runtime.hybrid import setup as hybrid_setup
from moe_runtime.layers.attention_graphs import AttentionGraphs
from moe_runtime.layers.router_lookahead import RouterLookahead
from moe_runtime.loader import LoadedModel, load_checkpoint
from moe_runtime.memory_plan import buffer_slot_count, engine_devices, human_bytes, kv_cache_len
from moe_runtime.memory_split import split_for
from moe_runtime.model import MoEModel
from moe_runtime.prefetch import make_prefetch_policy
from moe_runtime.stats import EngineStats

MiB = 1 << 20


class LLMEngine(RequestAdmission, StepOutputs, PromptScoring):
    """Serve one checkpoint with experts offloaded.

    Args:
        loaded: a :class:`LoadedModel` (see :meth:`from_pretrained`).
        runtime: the user's settings.
        recorder: the tracer's ``RequestRecorder`` (or any object with its methods), or None. The
            ``eam`` policies need one; it is created (with an EAMC of ``runtime.eamc_capacity``)
            when they are chosen and none is given.
        eamc: the EAM collection the ``eam`` prefetch policy matches against (default: the
            recorder's).
        policy_context: extra policy inputs, e.g. ``{"oracle": OracleSchedule(...)}``.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        runtime: RuntimeConfig,
        recorder: Any | None = None,
        eamc: Any | None = None,
        policy_context: dict[str, Any] | None = None,
    ) -> None:
        cfg = loaded.config
        # the memory plan fixes the slots and KV blocks where it knows the device's memory
        self.memory_split = split_for(loaded, runtime)
        runtime = self.memory_split.runtime
        total = cfg.num_moe_layers * cfg.num_experts
        slots = buffer_slot_count(runtime, total)
        # With every expert resident no policy has anything to decide: skip their per-layer work.
        offloading = slots < total
        prefetch_policy = runtime.prefetch_policy if offloading else "on-demand"
        cache_policy = runtime.cache_policy if offloading else "lru"
        # hybrid expert execution (moe_runtime.hybrid): cpu mode keeps a fixed resident set, so
        # there is nothing to prefetch or evict
        self.expert_compute = runtime.expert_compute_mode
        if self.expert_compute == "cpu":
            prefetch_policy, cache_policy = "on-demand", "lru"
        if (prefetch_policy.startswith("eam") or cache_policy.startswith("eam")) and recorder is None:
            recorder = _default_recorder(cfg, runtime, eamc)
        if eamc is None and recorder is not None:
            eamc = getattr(recorder, "eamc", None)
        self.eamc = eamc
        self.loaded, self.runtime, self.recorder = loaded, runtime, recorder
        if runtime.cpu_threads is not None:
            torch.set_num_threads(runtime.cpu_threads)
        keep_freed_memory()  # large temporaries reuse freed heap instead of faulting fresh pages
        self.config = cfg
        self.tokenizer = loaded.tokenizer
        self.max_model_len = kv_cache_len(cfg, runtime)
        n_dev = runtime.num_devices
        device = runtime.torch_device  # ``cuda`` -> the current CUDA device, indexed
        devices = engine_devices(runtime)
        link = (runtime.link_gbps, runtime.link_latency_us) if runtime.link_gbps else None
        context = {"recorder": recorder, **(policy_context or {})}
        self.buffer = ExpertBuffer(
            loaded.store,
            devices,
            total if not offloading else math.ceil(slots / n_dev),
            cache_policy,
            link,
            context,
        )
        kv = build_kv(cfg, runtime, device, cfg.num_moe_layers, tracing=recorder is not None)
        self.kv_setup = kv
        self.kv = kv.cache  # the tensors; ``kv_manager`` the blocks
        self.kv_manager = kv.manager
        self.model = MoEModel(cfg, loaded.dense, self.buffer, self.kv, self.max_model_len)
        with device_scope(device):  # its probes and copies on the engine's device
            self.hybrid = hybrid_setup.attach(self.buffer, runtime, self.expert_compute)  # None: device mode
        step_context.warm()  # the step's expert attribution is compiled: not on the first step's clock
        self.prefetcher = make_prefetch_policy(
            prefetch_policy,
            buffer=self.buffer,
            num_layers=cfg.num_moe_layers,
            num_experts=cfg.num_experts,
            top_k=cfg.top_k,
            recorder=recorder,
            depth=runtime.prefetch_depth,
            eamc=eamc,
            lookahead=runtime.router_lookahead,
            **(policy_context or {}),
        )
        # the model records through a per-step filter: recomputed tokens are not counted twice,
        # and cached blocks keep their tokens' expert counts (prefix_eam)
        self.step_recorder = StepRecorder(recorder, kv.activations) if recorder is not None else None
        self.model.recorder = self.step_recorder
        # decode steps replayed from CUDA graphs where the forward can be captured (decode_graphs)
        flex = getattr(self.kv, "flex", None)
        capturable = device.type == "cuda" and runtime.cuda_graphs and n_dev == 1 and flex is not None
        self.graphs = DecodeGraphs(self.model, self.kv) if capturable else None
        # on the CPU, decode steps through one compiled forward where it applies (compiled_decode)
        compiled = device.type == "cpu" and runtime.compile_decode and n_dev == 1 and cfg.mla is None
        self.compiled = CompiledDecode(self.model, self.kv) if compiled else None
        self.model.segments = AttentionGraphs(self.model, self.kv) if capturable else None
        self.model.prefetcher = self.prefetcher
        if getattr(self.prefetcher, "lookahead_depth", 0) > 0:
            self.model.lookahead = RouterLookahead(
                cfg, loaded.dense, self.prefetcher.lookahead_depth, policy=self.prefetcher
            )
        self.scheduler = Scheduler(runtime.max_batch_size, runtime.max_num_batched_tokens, kv.manager)
        self.eos_token_ids = loaded.eos_token_ids
        self.stats = EngineStats(kv_blocks_total=kv.manager.num_blocks)
        self._seqs: dict[str, Sequence] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._matchers: dict[str, GrammarMatcher] = {}  # sequences with a grammar (structured output)
        self.device = device
        self.last_logits: torch.Tensor | None = None

    @property
    def num_steps(self) -> int:
        return self.stats.steps

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        runtime: RuntimeConfig | None = None,
        recorder: Any | None = None,
        **kwargs: Any,
    ) -> LLMEngine:
        """Load ``model_dir`` and build the engine; ``kwargs`` go to the constructor (``eamc``, ...)."""
        runtime = runtime or RuntimeConfig()
        return cls(load_checkpoint(model_dir, runtime), runtime, recorder, **kwargs)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Run one forward pass over the scheduled batch; return one output per request that
        produced a token or finished. On CUDA the calling thread's current device is the engine's
        meanwhile (``device_scope``): any thread may step an engine on any device."""
        with device_scope(self.device):
            return self._step()

    def _step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        self._sync_kv_stats()
        if not scheduled:
            return []
        t0 = time.perf_counter()
        self._credit_hits(scheduled)
        ids: list[int] = []
        past, tables, prompt_lens = [], [], []
        for s in scheduled:
            seq, c = s.seq, s.seq.num_computed
            past.append(c)
            tables.append(self.kv_manager.tables(seq))
            prompt_lens.append(len(seq.prompt_token_ids))
            ids.extend(seq.tokens(c, s.num_new))
        step = StepContext.build(
            [s.seq.request_id for s in scheduled],
            tables,
            past,
            [s.num_new for s in scheduled],
            [s.sample for s in scheduled],
            self.device,
            self.kv_manager.block_size,
            prompt_lens=prompt_lens,
        )
        self._begin_recording(scheduled, step)
        scored = self._score_prompts(scheduled, step)
        logits = self._forward(torch.tensor(ids, dtype=torch.int64, device=self.device), step)
        if scored:
            logits = self._take_prompt_logprobs(scheduled, logits, scored)
        self.last_logits = logits  # [N, V] fp32, rows in scheduled order of sampling sequences
        self._end_recording(step)
        self.prefetcher.end_step()
        sampling = [s.seq for s in scheduled if s.sample]
        picks = sample(
            logits,
            [q.params for q in sampling],
            [self._generators.get(q.request_id) for q in sampling],
            history=[(q.prompt_token_ids, q.output_token_ids) for q in sampling]
            if any(q.params.penalized for q in sampling)
            else None,
            allowed=self._allowed(sampling),
        )
        outputs = self._update(scheduled, step, dict(zip((q.request_id for q in sampling), picks)))
        self.stats.steps += 1
        self.stats.step_seconds += time.perf_counter() - t0
        self._sync_kv_stats()
        return outputs

    def _credit_hits(self, scheduled: list[ScheduledSeq]) -> None:
        """A sequence admitted with a prefix-cache hit whose tokens the tracer has not counted is
        credited its hit blocks' stored expert counts (``prefix_eam``)."""
        for s in scheduled:
            seq, hit = s.seq, s.hit
            if hit is None or seq.num_recorded >= hit.tokens:
                continue
            acts, group = self.kv_setup.activations, self.kv_setup.activation_group
            if self.recorder is not None and acts is not None and group is not None and seq.num_recorded == 0:
                self.recorder.credit(seq.request_id, acts.counts(hit.blocks[group]))
            self._mark_recorded(seq, hit.tokens)

    def _begin_recording(self, scheduled: list[ScheduledSeq], step: StepContext) -> None:
        """Tell the step recorder which tokens the tracer counts: those at positions it has not
        counted yet (a recompute after preemption repeats the others)."""
        if self.step_recorder is None:
            return
        recorded = np.asarray([s.seq.num_recorded for s in scheduled], dtype=np.int64)
        keep = None
        if (recorded > np.asarray([s.seq.num_computed for s in scheduled])).any():
            keep = step.positions_host >= recorded[step.token_seq]
        self.step_recorder.begin(step.token_seq, step.token_prefill, keep)

    def _end_recording(self, step: StepContext) -> None:
        if self.recorder is None:
            return
        self.recorder.end_step()
        group = self.kv_setup.activation_group
        if self.kv_setup.activations is None or group is None or not step.observe:
            self.step_recorder.end(None, None)
            return
        bs = step.block_size
        positions = step.positions_host
        blocks = step.tables_host[group][step.token_seq, positions // bs]
        self.step_recorder.end(blocks, positions % bs == 0)

    def _sync_kv_stats(self) -> None:
        st, kv = self.stats, self.kv_manager
        st.preemptions = self.scheduler.num_preemptions
        st.prefix_cache_queries, st.prefix_cache_hits = kv.queries, kv.hits
        st.kv_blocks_used = kv.num_blocks - kv.num_free

    def _allowed(self, sampling: list[Sequence]) -> dict[int, torch.Tensor] | None:
        """Row -> grammar mask ``[V]`` of the sampling rows that have a grammar."""
        if not self._matchers:
            return None
        return {
            i: self._matchers[q.request_id].allowed().to(self.device)
            for i, q in enumerate(sampling)
            if q.request_id in self._matchers
        }

    # ------------------------------------------------------------------ conveniences
    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[RequestOutput]:
        """Run prompts to completion together; returns each request's final output, in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{id(self)}-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r] for r in ids]

    def capture_graphs(self) -> tuple[int, float]:
        """Capture the decode graphs of batch sizes up to 16 now (``decode_graphs.capture_at_start``)
        rather than at each size's first step, or on the CPU compile the decode step's variants
        (``compiled_decode``); ``(graphs or variants, seconds)``."""
        if self.compiled is not None:
            return self.compiled.warm_up(self.runtime.max_batch_size)
        t0 = time.perf_counter()
        with device_scope(self.device):  # the graphs are captured on the engine's device's stream
            n = capture_at_start(self.graphs, self.model.segments, self.runtime.max_batch_size)
        return n, time.perf_counter() - t0

    def _forward(self, input_ids: torch.Tensor, step: StepContext) -> torch.Tensor:
        """The model's logits for the step: from a decode graph (CUDA) or the compiled forward
        (CPU) where one applies, else eager."""
        if self.graphs is not None:
            return self.graphs.forward(input_ids, step)
        if self.compiled is not None:
            return self.compiled.forward(input_ids, step)
        return self.model.forward(input_ids, step)

    def summary(self) -> str:
        """One line: dense bytes on device, expert bytes in host memory, slots and their bytes, the
        KV cache (blocks, sliding layers, prefix caching) and its attention path, the expert path
        (``grouped`` GEMMs or a per-expert ``loop``); after the memory plan's two lines when it
        sized the split (``MemorySplit.describe``)."""
        st, buf = self.loaded.store, self.buffer
        plan = self.memory_split.describe()
        total = st.num_layers * st.num_experts
        itemsize = torch.empty((), dtype=self.runtime.torch_dtype).element_size()
        return (plan + "\n" if plan else "") + (
            f"{self.config.architecture}: dense {self.loaded.dense_nbytes / MiB:.1f} MiB on {self.device}, "
            f"experts {st.nbytes / MiB:.1f} MiB in host memory ({total} experts x "
            f"{st.expert_nbytes / MiB:.2f} MiB{', pinned' if st.data.is_pinned() else ''}), "
            f"buffer {buf.num_slots} slots x {st.expert_nbytes / MiB:.2f} MiB = "
            f"{buf.num_slots * st.expert_nbytes / MiB:.1f} MiB "
            f"({100 * min(buf.num_slots, total) / total:.0f}% "
            f"of experts) on {len(buf.parts)} device(s), "
            f"{self.kv_setup.describe(itemsize)}, "
            f"{self._expert_format()}, "
            f"{hybrid_setup.describe(self.hybrid, self.runtime, self.expert_compute)}, "
            f"experts run {self.model.expert_path}"
            + (f", {self.graphs.describe()}" if self.graphs is not None else "")
            + (f", {self.compiled.describe()}" if self.compiled is not None else "")
            + (f", {self.model.segments.describe()}" if self.model.segments is not None else "")
            + (", random weights (--load-format dummy)" if self.runtime.load_format == "dummy" else "")
        )

    def _expert_format(self) -> str:
        """``experts fp8 e4m3 block [64, 64], 24.0 KiB per expert (96.0 KiB unquantized)``: the
        bytes each copy moves, before and after quantizing (the same without quantization)."""
        st = self.loaded.store
        plain = str(st.compute_dtype).removeprefix("torch.")
        name = st.layout.describe() if st.layout else plain
        return (
            f"experts {name}, {human_bytes(st.expert_nbytes)} per expert "
            f"({human_bytes(st.plain_nbytes)} in {plain})"
        )

    def close(self) -> None:
        if self.hybrid is not None:
            self.hybrid.close()
        self.buffer.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _default_recorder(cfg, runtime: RuntimeConfig, eamc: Any | None) -> Any:
    """A tracer recorder with an EAMC, for the ``eam`` policies."""
    try:
        from tracer.eamc import EAMC
        from tracer.recorder import RequestRecorder
    except ImportError as exc:  # pragma: no cover - the tracer ships with the package
        raise ConfigError(f"the eam policies need the tracer package ({exc})") from None
    if eamc is None:
        eamc = EAMC(cfg.num_moe_layers, cfg.num_experts, capacity=runtime.eamc_capacity)
    return RequestRecorder(cfg.num_moe_layers, cfg.num_experts, cfg.top_k, eamc=eamc)
