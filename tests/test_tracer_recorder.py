"""RequestRecorder: attribution under batching, row sums, query semantics, commit/abort."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracer.eamc import EAMC
from tracer.recorder import RequestRecorder
from tracer.trace_file import TraceWriter, load_traces

L, E, K = 3, 6, 2


class _Script:
    """Random per-request routing: ``routes[rid]`` is (T, L, k) ids, the first ``prompt`` prefill."""

    def __init__(self, seed: int, prompts: dict[str, int], decode: dict[str, int]) -> None:
        rng = np.random.default_rng(seed)
        self.prompts, self.decode = prompts, decode
        self.routes = {
            rid: np.argsort(rng.random((prompts[rid] + decode[rid], L, E)), axis=-1)[..., :K]
            for rid in prompts
        }
        self.weights = {rid: rng.random(r.shape, dtype=np.float32) for rid, r in self.routes.items()}

    def steps(self, rids: list[str], chunk: int) -> list[list[tuple[str, int, int, bool]]]:
        """Engine steps: per step, (rid, first token, count, prefill) for each scheduled request."""
        pos = dict.fromkeys(rids, 0)
        out = []
        while any(pos[r] < self.prompts[r] + self.decode[r] for r in rids):
            step = []
            for r in rids:
                p = pos[r]
                if p < self.prompts[r]:
                    n = min(chunk, self.prompts[r] - p)
                    step.append((r, p, n, True))
                elif p < self.prompts[r] + self.decode[r]:
                    n = 1
                    step.append((r, p, 1, False))
                else:
                    continue
                pos[r] += n
            out.append(step)
        return out


def _inputs(step: list[tuple[str, int, int, bool]]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """A scripted step's request ids, ``token_seq`` and ``token_prefill``."""
    ids = [r for r, _, _, _ in step]
    seq = np.concatenate([np.full(n, b) for b, (_, _, n, _) in enumerate(step)]).astype(np.int64)
    prefill = np.concatenate([np.full(n, pf) for _, _, n, pf in step])
    return ids, seq, prefill


def _topk(script: _Script, step: list[tuple[str, int, int, bool]], layer: int) -> np.ndarray:
    """A scripted step's ``[T, k]`` expert ids at ``layer``."""
    return np.concatenate([script.routes[r][p : p + n, layer] for r, p, n, _ in step])


def _drive(rec: RequestRecorder, script: _Script, rids: list[str], chunk: int = 4) -> None:
    for step in script.steps(rids, chunk):
        ids_batch, seq, prefill = _inputs(step)
        for layer in range(L):
            topk = _topk(script, step, layer)
            w = np.concatenate([script.weights[r][p : p + n, layer] for r, p, n, _ in step])
            rec.record(layer, ids_batch, seq, prefill, topk, w)
        rec.end_step()


def _alone(script: _Script, rid: str) -> tuple[np.ndarray, np.ndarray]:
    rec = RequestRecorder(L, E, K)
    rec.begin_request(rid, script.prompts[rid])
    _drive(rec, script, [rid])
    return rec.request_eam(rid)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    prompts=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    decode=st.lists(st.integers(0, 5), min_size=4, max_size=4),
    chunk=st.integers(1, 6),
)
def test_batching_never_mixes_requests(seed: int, prompts: list[int], decode: list[int], chunk: int) -> None:
    rids = [f"r{i}" for i in range(len(prompts))]
    script = _Script(seed, dict(zip(rids, prompts, strict=False)), dict(zip(rids, decode, strict=False)))
    rec = RequestRecorder(L, E, K)
    for r in rids:
        rec.begin_request(r, script.prompts[r])
    _drive(rec, script, rids, chunk)
    for r in rids:
        prefill, dec = rec.request_eam(r)
        alone_p, alone_d = _alone(script, r)
        np.testing.assert_array_equal(prefill, alone_p)
        np.testing.assert_array_equal(dec, alone_d)
        # row sum == tokens seen at that layer x top_k, prefill and decode apart
        assert (prefill.sum(axis=1) == script.prompts[r] * K).all()
        assert (dec.sum(axis=1) == script.decode[r] * K).all()


def test_query_adds_this_steps_rows_up_to_the_layer() -> None:
    rec = RequestRecorder(L, E, K)
    rec.begin_request("a", 2)
    rec.begin_request("b", 1)
    seq, pf = np.array([0, 0, 1]), np.ones(3, bool)
    ids = np.array([[0, 1], [0, 2], [5, 4]])
    rec.record(0, ["a", "b"], seq, pf, ids, np.ones((3, 2), np.float32))
    q = rec.query(["b", "a"], upto_layer=0)
    assert q.shape == (2, L, E) and q.dtype == np.float32
    assert q[1, 0].tolist() == [2, 1, 1, 0, 0, 0] and q[0, 0].tolist() == [0, 0, 0, 0, 1, 1]
    assert (q[:, 1:] == 0).all()
    rec.record(1, ["a", "b"], seq, pf, ids, np.ones((3, 2), np.float32))
    assert (rec.query(["a"], upto_layer=0)[0, 1] == 0).all()  # layer 1 not included yet
    assert rec.query(["a"], upto_layer=1)[0, 1].sum() == 4
    rec.end_step()
    assert rec.request_eam("a")[0].sum() == 8  # layers 0 and 1, 2 tokens x 2 choices
    # next step: earlier steps show on every row, whatever upto_layer
    assert rec.query(["a"], upto_layer=-1)[0].sum(axis=1).tolist() == [4, 4, 0]


def test_finish_commits_to_eamc_and_abort_does_not(tmp_path: Path) -> None:
    eamc = EAMC(L, E, capacity=4)
    writer = TraceWriter(tmp_path / "t.jsonl")
    rec = RequestRecorder(L, E, K, eamc=eamc, trace_writer=writer)
    script = _Script(1, {"a": 3, "b": 2, "c": 2}, {"a": 2, "b": 1, "c": 0})
    for r in ("a", "b", "c"):
        rec.begin_request(r, script.prompts[r], task="demo")
    _drive(rec, script, ["a", "b", "c"], chunk=2)
    total_a = sum(rec.request_eam("a"))
    rec.finish("a")
    rec.abort("b")
    rec.begin_request("idle", 5)
    rec.finish("idle")  # routed nothing: released without a commit
    writer.close()
    assert len(eamc) == 1
    np.testing.assert_allclose(eamc.search(total_a, k=1)[0][0, 0], L, rtol=1e-5)
    records = load_traces(tmp_path / "t.jsonl")
    assert [r.request_id for r in records] == ["a"]
    tr = records[0]
    assert (tr.task, tr.prompt_len, tr.num_prefill, tr.num_tokens) == ("demo", 3, 3, 5)
    np.testing.assert_array_equal(tr.ids, script.routes["a"])
    np.testing.assert_allclose(tr.weights, np.round(script.weights["a"], 4), atol=1e-6)
    np.testing.assert_array_equal(tr.eam(prefill=True), rec_eam := _alone(script, "a")[0])
    assert rec_eam.sum() == 3 * L * K
    assert rec.live_requests == ["c"]
    with pytest.raises(KeyError):
        rec.request_eam("b")


def test_finish_includes_an_open_step() -> None:
    eamc = EAMC(L, E, capacity=2)
    rec = RequestRecorder(L, E, K, eamc=eamc)
    rec.begin_request("a", 1)
    for layer in range(L):
        rec.record(
            layer, ["a"], np.array([0]), np.array([True]), np.array([[1, 2]]), np.ones((1, 2), np.float32)
        )
    rec.finish("a")  # no end_step: the step's counts are still committed
    assert len(eamc) == 1 and (eamc.entries()[0][:, [1, 2]] > 0).all()


def test_slots_are_reused_and_zeroed() -> None:
    rec = RequestRecorder(L, E, K)
    for i in range(20):
        rec.begin_request(f"r{i}", 1)
        rec.record(
            0, [f"r{i}"], np.array([0]), np.array([False]), np.array([[0, 1]]), np.ones((1, 2), np.float32)
        )
        rec.end_step()
        assert rec.request_eam(f"r{i}")[1].sum() == 2
        rec.finish(f"r{i}")
    assert rec._eam.shape[0] == 8  # one slot, recycled


def test_bad_calls_rejected() -> None:
    rec = RequestRecorder(L, E, K)
    rec.begin_request("a", 1)
    one = np.ones((1, 2), np.float32)
    with pytest.raises(ValueError, match="already"):
        rec.begin_request("a", 1)
    with pytest.raises(KeyError, match="'zz' was not begun"):
        rec.record(0, ["zz"], np.array([0]), np.array([True]), np.array([[0, 1]]), one)
    with pytest.raises(ValueError, match="moe_layer"):
        rec.record(L, ["a"], np.array([0]), np.array([True]), np.array([[0, 1]]), one)
    # expert ids are checked when the layers are counted, at the next read
    rec.record(0, ["a"], np.array([0]), np.array([True]), np.array([[0, E]]), one)
    rec.end_step()
    with pytest.raises(ValueError, match=r"expert ids .* layer\(s\) \[0\]"):
        rec.query(["a"], -1)
    rec.record(1, ["a"], np.array([0]), np.array([True]), np.array([[-1, 1]]), one)
    with pytest.raises(ValueError, match="expert ids"):
        rec.request_eam("a")
    assert rec.query(["a"], 1).sum() == 0  # the bad layers were dropped, not counted
    with pytest.raises(ValueError, match="must be"):
        rec.record(0, ["a"], np.array([0, 0]), np.array([True]), np.array([[0, 1]]), one)
    with pytest.raises(KeyError):
        rec.finish("zz")


def test_query_is_answered_once_per_layer_and_follows_every_change():
    import numpy as np

    from tracer.recorder import RequestRecorder

    rec = RequestRecorder(2, 4, 1)
    rec.begin_request("a", 1)
    ids = ["a"]
    rec.record(0, ids, np.array([0]), np.array([True]), np.array([[1]]), np.ones((1, 1), np.float32))
    q = rec.query(ids, 0)
    assert rec.query(["a"], 0) is q and not q.flags.writeable  # same answer, shared read-only
    rec.record(1, ids, np.array([0]), np.array([True]), np.array([[2]]), np.ones((1, 1), np.float32))
    assert rec.query(ids, 1)[0, 1, 2] == 1  # a new routed layer is seen
    rec.end_step()
    assert rec.query(ids, -1)[0].sum() == 2  # the closed step counts as earlier steps
    rec.begin_request("b", 1)
    assert rec.query(["a", "b"], -1).shape == (2, 2, 4)


def test_slot_order_does_not_change_the_counts() -> None:
    """Batches whose slots are consecutive (indexed by a slice) or not (gathered) count alike."""
    script = _Script(7, {"a": 3, "b": 2, "c": 4}, {"a": 2, "b": 3, "c": 1})

    def run(order: list[str], begin: list[str]) -> tuple[RequestRecorder, list[np.ndarray]]:
        rec = RequestRecorder(L, E, K)
        rec.begin_request("gap", 1)  # holds slot 0, then frees it: "begin" need not be consecutive
        for r in begin:
            rec.begin_request(r, script.prompts[r])
        rec.abort("gap")
        answers = []
        for step in script.steps(order, chunk=2):
            ids_batch = [r for r, _, _, _ in step]
            seq = np.concatenate([np.full(n, b) for b, (_, _, n, _) in enumerate(step)]).astype(np.int64)
            prefill = np.concatenate([np.full(n, pf) for _, _, n, pf in step])
            for layer in range(L):
                topk = np.concatenate([script.routes[r][p : p + n, layer] for r, p, n, _ in step])
                w = np.ones(topk.shape, np.float32)
                rec.record(layer, ids_batch, seq, prefill, topk, w)
                answers.append(rec.query(sorted(ids_batch), layer))
            rec.end_step()
        return rec, answers

    ref, ref_answers = run(["a", "b", "c"], ["a", "b", "c"])
    for order, begin in ((["c", "a", "b"], ["a", "b", "c"]), (["a", "b", "c"], ["c", "b", "a"])):
        rec, answers = run(order, begin)
        for want, got in zip(ref_answers, answers, strict=True):
            np.testing.assert_array_equal(want, got)
        for r in ("a", "b", "c"):
            for want, got in zip(ref.request_eam(r), rec.request_eam(r), strict=True):
                np.testing.assert_array_equal(want, got)


def test_epoch_moves_only_when_earlier_step_counts_or_live_requests_change() -> None:
    rec = RequestRecorder(L, E, K)
    e0 = rec.epoch
    rec.begin_request("a", 1)
    rec.begin_request("b", 1)
    assert rec.epoch > e0
    e1 = rec.epoch
    ids = np.zeros((2, K), dtype=np.int64)
    ids[:, 1] = 1
    rec.record(0, ["a", "b"], np.arange(2), np.ones(2, bool), ids, np.ones(ids.shape, np.float32))
    rec.query(["a", "b"], 0)
    assert rec.epoch == e1  # within a step only the routed rows change
    rec.end_step()
    assert rec.epoch > e1
    e2 = rec.epoch
    rec.end_step()  # nothing routed: nothing changed
    assert rec.epoch == e2
    rec.finish("a")
    assert rec.epoch > e2
    e3 = rec.epoch
    rec.abort("b")
    assert rec.epoch > e3


def test_query_sum_equals_the_summed_query_as_layers_and_steps_go() -> None:
    rng = np.random.default_rng(7)
    L, E, k = 4, 6, 2
    rec = RequestRecorder(L, E, k)
    for r in ("a", "b", "c"):
        rec.begin_request(r, 3)
    batches = [["a", "b", "c"], ["a", "c"], ["a", "c"]]
    for step, ids in enumerate(batches):
        seq = np.arange(len(ids))
        for layer in range(L):
            topk = rng.integers(0, E, size=(len(ids), k))
            rec.record(layer, ids, seq, np.zeros(len(ids), bool), topk, np.ones((len(ids), k), np.float32))
            got = rec.query_sum(ids, layer)
            np.testing.assert_array_equal(got, rec.query(ids, layer).sum(axis=0))
            if layer == 1:  # asking about an earlier layer again, then later ones, stays right
                np.testing.assert_array_equal(rec.query_sum(ids, 0), rec.query(ids, 0).sum(axis=0))
        rec.end_step()
        if step == 0:
            rec.finish("b")
        live = ["a", "c"]
        np.testing.assert_array_equal(rec.query_sum(live, -1), rec.query(live, -1).sum(axis=0))


@pytest.mark.parametrize("sparse", [True, False])
def test_query_rows_are_the_querys_rows_and_sparse_counts_equal_dense(sparse: bool, monkeypatch) -> None:
    """``query_rows`` equals the routed rows of ``query`` bit for bit as layers and steps go, and
    the scatter-add form of the count (few ids against many cells) and the bincount form both
    give the EAMs counted by hand."""
    import tracer.recorder_counts as counts

    monkeypatch.setattr(counts, "_SPARSE_RATIO", 0 if sparse else 1 << 40)  # always / never sparse
    rng = np.random.default_rng(3)
    L, E, k = 5, 7, 2
    rec = RequestRecorder(L, E, k)
    for r in ("a", "b", "c", "d"):
        rec.begin_request(r, 2)
    rec.abort("a")  # "b", "c", "d" then hold slots 1-3; ["d", "b"] is gathered, not sliced
    want = {r: np.zeros((2, L, E), dtype=np.int64) for r in "bcd"}  # (prefill, decode) by hand
    script = [(["b", "c", "d"], [2, 1, 1]), (["d", "b"], [1, 3]), (["b", "c", "d"], [1, 1, 1])]
    for step, (ids, tokens) in enumerate(script):
        seq = np.repeat(np.arange(len(ids)), tokens)
        prefill = np.full(len(seq), step == 0)
        for layer in range(L):
            topk = np.argsort(rng.random((len(seq), E)), axis=1)[:, :k]
            rec.record(layer, ids, seq, prefill, topk, None)
            for t, b in enumerate(seq):
                want[ids[b]][int(step > 0), layer, topk[t]] += 1
            if layer % 2:  # reads after some layers only: several layers counted together
                lo = int(rng.integers(0, layer + 1))
                got = rec.query_rows(ids, lo, layer + 1)
                np.testing.assert_array_equal(got, rec.query(ids, layer)[:, lo : layer + 1])
        rec.end_step()
    for r, eam in want.items():
        np.testing.assert_array_equal(np.stack(rec.request_eam(r)), eam)
    with pytest.raises(ValueError, match="outside"):
        rec.query_rows(["b"], 3, L + 1)


def test_query_sum_weighs_prompt_tokens_by_prefill_weight() -> None:
    """``query_sum(..., prefill_weight=w)`` is ``decode + w * prefill`` of the requests' EAMs,
    the open step's rows up to the layer included."""
    script = _Script(3, {"a": 5, "b": 3}, {"a": 4, "b": 4})
    rec = RequestRecorder(L, E, K)
    for r in ("a", "b"):
        rec.begin_request(r, script.prompts[r])
    steps = script.steps(["a", "b"], chunk=2)
    for i, step in enumerate(steps):
        ids, seq, prefill = _inputs(step)
        for layer in range(L):
            rec.record(layer, ids, seq, prefill, _topk(script, step, layer), None)
            if i == len(steps) - 1 and layer == 1:  # mid-step: rows <= 1 hold the open step
                break
        else:
            rec.end_step()
            continue
        break
    ids = ["a", "b"]
    # by hand from the script: every token routed so far, layers <= 1 of the open step included
    want = np.zeros((2, L, E))  # [phase, L, E]
    for step_no, step in enumerate(steps):
        for r, p, n, pf in step:
            for layer in range(L):
                if step_no == len(steps) - 1 and layer > 1:
                    continue
                for t in range(p, p + n):
                    np.add.at(want[0 if pf else 1, layer], script.routes[r][t, layer], 1)
    for w in (1.0, 0.05, 0.0):
        got = rec.query_sum(ids, 1, prefill_weight=w)
        np.testing.assert_allclose(got, want[1] + w * want[0])
    np.testing.assert_array_equal(rec.query_sum(ids, 1), rec.query(ids, 1).sum(axis=0))


def test_prompt_weighted_query_sum_kept_across_layers_equals_a_fresh_one() -> None:
    """Asked layer by layer (as the cache does, beside the unweighted form the prefetcher asks
    for), the running prompt-weighted sum equals one computed from the phase tables afresh, across
    steps, a request finishing and a layer recorded again after it was summed."""
    script = _Script(5, {"a": 4, "b": 6, "c": 2}, {"a": 5, "b": 3, "c": 6})
    rec = RequestRecorder(L, E, K)
    for r in ("a", "b", "c"):
        rec.begin_request(r, script.prompts[r])

    def fresh(ids, upto, w):
        phases = sum(np.stack(rec.request_eam(r)) for r in ids).astype(np.float64)  # finished steps
        rows = rec._rows(ids)
        phases[:, : upto + 1] += rec._step[rows, :, : upto + 1].sum(axis=0)
        return phases[1] + w * phases[0]

    steps = script.steps(["a", "b", "c"], chunk=3)
    last = {r: i for i, step in enumerate(steps) for r, _, _, _ in step}  # each request's last step
    for i, step in enumerate(steps):
        ids, seq, prefill = _inputs(step)
        for layer in range(L):
            topk = _topk(script, step, layer)
            rec.record(layer, ids, seq, prefill, topk, None)
            got = rec.query_sum(ids, layer, prefill_weight=0.05)
            rec.query_sum(ids, layer)  # the other form in between
            np.testing.assert_allclose(got, fresh(ids, layer, 0.05))
        rec.record(L - 1, ids, seq, prefill, topk, None)  # the last layer again, after its sum
        np.testing.assert_allclose(rec.query_sum(ids, L - 1, prefill_weight=0.05), fresh(ids, L - 1, 0.05))
        rec.end_step()
        for r in ids:
            if last[r] == i and len(ids) > 1:  # the batch shrinks: a new batch and epoch
                rec.finish(r)
