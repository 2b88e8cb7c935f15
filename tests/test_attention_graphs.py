"""Each layer's attention block of a decode step from a graph (``moe_runtime.layers.attention_graphs``),
on the CPU with the stand-in that re-runs the captured block on the graph's static inputs
(``tests/test_decode_graphs.py`` has the engine set-up): with offloaded experts, copied or computed
on the CPU, the same logits bit for bit as the eager blocks, one graph per layer and batch size; no
layer captured inside a whole-step graph; a stale input shows."""

from __future__ import annotations

import pytest
import torch
from test_decode_graphs import PARAMS, _engine, _run, checkpoints  # noqa: F401  (the fixture)

from moe_runtime.layers.attention_graphs import StepSegments


@pytest.mark.parametrize(
    ("family", "runtime"),
    [
        ("qwen3_moe", {"buffer_fraction": 0.5}),
        ("qwen3_moe", {"buffer_slots": 2, "expert_compute": "cpu"}),
        ("gpt_oss", {"buffer_slots": 2}),
    ],
    ids=["copied", "cpu-experts", "gpt-oss"],
)
def test_blocks_from_graphs_give_the_eager_logits(checkpoints, monkeypatch, family, runtime):  # noqa: F811
    got, stats = {}, {}
    for segments in (False, True):
        with _engine(checkpoints[family], monkeypatch, False, segments, **runtime) as engine:
            got[segments] = _run(engine)
            st = engine.buffer.stats
            # (hits and bytes copied depend on when prefetches land: not compared)
            stats[segments] = (st.lookups, sum(st.cpu_experts))
            if segments:
                layers = engine.loaded.config.num_layers
                assert sorted(engine.model.segments.graphs) == [
                    (layer, b) for layer in range(layers) for b in (1, 2, 3)
                ]
                decode_steps = max(p.max_tokens for p in PARAMS) - 1
                assert engine.model.segments.replays == layers * decode_steps
    assert stats[True] == stats[False]
    for (tokens, logits), (ref_tokens, ref_logits) in zip(got[True], got[False]):
        assert tokens == ref_tokens and torch.equal(logits, ref_logits)


def test_no_block_is_captured_inside_a_whole_step_graph(checkpoints, monkeypatch):  # noqa: F811
    with _engine(checkpoints["qwen3_moe"], monkeypatch, True, True) as engine:
        got = _run(engine)
        assert engine.graphs.replays > 0 and engine.model.segments.graphs == {}
    with _engine(checkpoints["qwen3_moe"], monkeypatch, False) as engine:
        ref = _run(engine)
    assert all(torch.equal(a[1], b[1]) for a, b in zip(got, ref))


def test_a_stale_residual_shows(checkpoints, monkeypatch):  # noqa: F811
    """The check has teeth: blocks whose residual input is not refreshed give other logits."""
    run = StepSegments.run

    def stale(self, layer, lw, h, x):
        entry = self.owner.graphs.get((layer, self.b))
        if entry is not None:  # the copy of x skipped: the first step's residual stays
            x = entry[1].clone()
        return run(self, layer, lw, h, x)

    with _engine(checkpoints["qwen3_moe"], monkeypatch, False, buffer_fraction=0.5) as engine:
        ref = _run(engine)
    monkeypatch.setattr(StepSegments, "run", stale)
    with _engine(checkpoints["qwen3_moe"], monkeypatch, False, True, buffer_fraction=0.5) as engine:
        got = _run(engine)
    assert not torch.equal(got[0][1], ref[0][1])


def test_a_failed_capture_keeps_serving_eagerly(checkpoints, monkeypatch):  # noqa: F811
    """A capture that raises (here: every capture) turns both kinds of graphs off with a warning;
    the step that met it and every later one run eagerly, with the eager logits."""
    import moe_runtime.engine.decode_graphs as decode_graphs
    import moe_runtime.layers.attention_graphs as attention_graphs

    def refuse(fn, pool, emulate):
        raise RuntimeError("operation not permitted when stream is capturing")

    with _engine(checkpoints["qwen3_moe"], monkeypatch, False, buffer_fraction=0.5) as engine:
        ref_offloaded = _run(engine)
    with _engine(checkpoints["qwen3_moe"], monkeypatch, False) as engine:
        ref_resident = _run(engine)
    monkeypatch.setattr(decode_graphs, "capture", refuse)
    monkeypatch.setattr(attention_graphs, "capture", refuse)
    for runtime, ref in (({"buffer_fraction": 0.5}, ref_offloaded), ({}, ref_resident)):
        with _engine(checkpoints["qwen3_moe"], monkeypatch, True, True, **runtime) as engine:
            got = _run(engine)
            assert not engine.graphs.enabled or not engine.model.segments.enabled
            assert engine.graphs.replays == engine.model.segments.replays == 0
            assert "off (a capture failed)" in engine.summary()
        for (tokens, logits), (ref_tokens, ref_logits) in zip(got, ref):
            assert tokens == ref_tokens and torch.equal(logits, ref_logits)


@pytest.mark.parametrize("runtime", [{}, {"buffer_fraction": 0.5}], ids=["resident", "offloaded"])
def test_graphs_captured_at_start_serve_every_step(checkpoints, monkeypatch, runtime):  # noqa: F811
    """``capture_graphs`` before the first request (as ``moeserve serve`` does): every batch size's
    whole-step graph (all resident) or every layer's attention graph (offloaded); the requests
    then capture nothing, give the eager logits, and no counter saw the stand-in steps."""
    with _engine(checkpoints["qwen3_moe"], monkeypatch, False, **runtime) as engine:
        ref = _run(engine)
        ref_lookups = engine.buffer.stats.lookups
    with _engine(checkpoints["qwen3_moe"], monkeypatch, True, True, **runtime) as engine:
        n, _ = engine.capture_graphs()
        layers = engine.loaded.config.num_layers
        counts = (len(engine.graphs.graphs), len(engine.model.segments.graphs))
        assert counts == ((3, 0) if not runtime else (0, 3 * layers)) and n == sum(counts)
        assert not any(engine.buffer.stats.lookups)  # per layer: none yet
        got = _run(engine)
        assert (len(engine.graphs.graphs), len(engine.model.segments.graphs)) == counts
        assert engine.buffer.stats.lookups == ref_lookups
    for (tokens, logits), (ref_tokens, ref_logits) in zip(got, ref):
        assert tokens == ref_tokens and torch.equal(logits, ref_logits)


def test_capturing_after_served_steps_keeps_the_graphs(checkpoints, monkeypatch):  # noqa: F811
    """``capture_graphs`` after steps ran (their inference-mode buffers exist) captures too: the
    graphs stay on, with the eager logits."""
    with _engine(checkpoints["qwen3_moe"], monkeypatch, False, buffer_fraction=0.5) as engine:
        ref = _run(engine)
    with _engine(checkpoints["qwen3_moe"], monkeypatch, False, True, buffer_fraction=0.5) as engine:
        _run(engine)
        engine.capture_graphs()
        assert engine.model.segments.enabled
        got = _run(engine)
    assert all(a[0] == b[0] and torch.equal(a[1], b[1]) for a, b in zip(got, ref))
