"""The weighed EAMC term (ours, runtime only): whether one predictor term of a plan pays for its
host time, measured online.

NOTE: why. The ``eam`` plan blends several predictors (router lookahead, the batch's own EAM,
the EAMC matches; MoE-Infinity §5.1 is the EAMC part). Each has its own precision, and each costs
the compute thread its own host time per planning layer. With the router lookahead on (the
default; plans then cover the next layer only) the EAMC term added 1.2 points of precision at
distance 1 on the bundled model (``tools/predictor_precision.py`` at abf5243: lookahead + own 0.475, the
full blend 0.487), about 0.2 more right candidates per plan of 16, while matching the running
batch against the EAMC and turning the matches into per-expert probabilities cost the runtime
about 65 us of a 230 us planning layer (thread CPU time, 25% buffer, 0.5 GB/s, batch 4). Where
one avoided miss saves less blocking than that, the term costs more than it buys.

So the term is weighed as the gate weighs a candidate (``moe_runtime.prefetch.gate``), from
figures measured in the same run:

* gain per plan ``= G * b``: ``G`` is the running mean of how many more of a plan's candidates
  are used with the term than without it. At every plan that computes the term, the policy also
  forms the plan it would have made without it (the same rows, the term left out) and notes both
  candidate sets of the next layer (``tokens x top-k`` best experts, those not held by the
  buffer: the ones a prefetch would copy); when that layer routes, each set's used experts are
  counted (:meth:`TermValue.observe`). ``b`` is the gate's blocking per miss.
* cost per plan: the running mean of the term's host time (thread CPU time of the matching and
  the probabilities, catching up the rows skipped in between included).

Only decode plans are weighed, timed and scored: a prefill plan ranks a whole prompt's routing
and its first match runs cold (the gate times only decode plans for the same reason), so it
always computes the term.

The term is computed at a plan while ``G * b`` beats its cost, before :data:`MIN_SCORED` plans
were scored, and otherwise once every ``probe_every`` plans, an interval that doubles with each
probe that finds the term still not paying, up to ``2 ** MAX_BACKOFF`` times (a probe after a
run of plans without the term matches from the full query: about 270 us in that runtime, so
probing every 4th plan cost more than it spared), to keep ``G`` and the cost current.
Plans without it use the other predictors only; the EAMC matcher catches up on the routed rows
it skipped at its next use, so a match is always the one the paper's per-layer matching gives.
The simulator, whose clock is not the host's, never skips the term (its host time is 0 there),
so its outputs are unchanged.
"""

from __future__ import annotations

import numpy as np

import moe_runtime.prefetch.term_kernels as term_kernels
from moe_runtime.prefetch.gate import routed_ids

# Plans scored before the test may skip the term (the running gain starts from these).
MIN_SCORED = 8
# A probe that finds the term not paying doubles the interval to the next, at most this many times.
MAX_BACKOFF = 4
# Weight of the past per new sample in the running gain and cost.
DECAY = 0.9
# A sample of the term's host time counts at most this many times the running mean.
HOST_CLIP = 4.0


class TermValue:
    """The measured gain and host time of one predictor term, and whether to compute it.

    Args:
        probe_every: while the term does not pay, compute it once every this many plans at first
            (>= 1; the interval doubles per probe that finds it still not paying).
        decay: weight of the past per new sample in the running figures, in ``[0, 1)``.

    Raises:
        ValueError: ``probe_every < 1`` or ``decay`` outside ``[0, 1)``.
    """

    def __init__(self, probe_every: int = 4, decay: float = DECAY) -> None:
        if probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {probe_every}")
        if not 0 <= decay < 1:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.probe_every, self.decay = probe_every, decay
        self.gain_hits = 0.0  # G: running extra used candidates per plan with the term
        self.host_s = 0.0  # running host seconds of the term per plan that computed it
        self.scored = 0  # plans whose two candidate sets were checked against routing
        self.used = 0  # plans that computed the term
        self.skipped = 0  # plans that left it out
        self._since = 0  # plans since the term was last computed
        self._interval = probe_every  # plans between probes while the term does not pay
        self._pending: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # layer -> (with, without)

    def wanted(self, block_s: float) -> bool:
        """Whether the plan about to be made should compute the term: too few plans were scored
        to tell, it pays (``G * block_s`` beats its host time), or it is a probe (each probe
        doubles the interval to the next, up to ``2 ** MAX_BACKOFF`` times ``probe_every``; a
        plan that finds the term paying resets it). Counts the plan as using or skipping the term.

        Args:
            block_s: seconds one avoided miss saves (the gate's blocking per miss ``b``).
        """
        self._since += 1
        if self.scored < MIN_SCORED:
            want = True
        elif self.gain_hits * block_s > self.host_s:
            want, self._interval = True, self.probe_every
        elif self._since >= self._interval:
            want = True
            self._interval = min(2 * self._interval, self.probe_every << MAX_BACKOFF)
        else:
            want = False
        if want:
            self._since = 0
            self.used += 1
        else:
            self.skipped += 1
        return want

    def note_host_time(self, seconds: float) -> None:
        """The term cost the compute thread ``seconds`` at a plan (the first sample sets the
        mean; later ones are clipped at :data:`HOST_CLIP` times it)."""
        if self.host_s == 0:
            self.host_s = seconds
            return
        seconds = min(seconds, HOST_CLIP * self.host_s)
        self.host_s = self.decay * self.host_s + (1 - self.decay) * seconds

    def note(self, layer: int, with_term: np.ndarray, without_term: np.ndarray) -> None:
        """Remember the candidate experts ``[n]`` (ids of layer ``layer``) a plan chose with the
        term and without it, to score both when ``layer`` routes."""
        self._pending[layer] = (with_term, without_term)

    def observe(self, layer: int, topk_ids: np.ndarray) -> None:
        """Layer ``layer`` routed ``topk_ids [T, k]``: if candidates were noted for it, the
        difference in used candidates (with the term minus without) updates ``G``."""
        pending = self._pending.pop(layer, None)
        if pending is None:
            return
        with_term, without_term = pending
        ids = routed_ids(topk_ids).reshape(-1)
        diff = term_kernels.used_difference(ids, _ids(with_term), _ids(without_term))
        self.gain_hits = diff if self.scored == 0 else self.decay * self.gain_hits + (1 - self.decay) * diff
        self.scored += 1

    def new_step(self) -> None:
        """Candidates of the finished step that were never checked are dropped."""
        self._pending.clear()


def _ids(experts: np.ndarray) -> np.ndarray:
    """``experts`` as the int64 array ``term_kernels.used_difference`` takes (itself when it is one)."""
    return experts if experts.dtype == np.int64 else experts.astype(np.int64)
