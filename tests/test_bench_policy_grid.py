"""``moeserve bench policies`` over a grid of links and batch sizes (:mod:`moeserve.bench.policy_grid`):
one JSON with every point, the prompts raised per batch, and the verdict table at the 1.02 bound
(hand-built ``bench policies --json`` points, and one short real grid on the bundled model)."""

from __future__ import annotations

import argparse
import io
import json
from contextlib import redirect_stdout

import pytest

from moeserve.bench import policies
from moeserve.bench.policy_grid import point_args, prompts_per_task, render_grid, run_grid, verdict
from moeserve.cli import main


def _row(fraction: float, policy: str, tpot: float, ratio: tuple[float, float, float], **extra) -> dict:
    return {
        "buffer_fraction": fraction,
        "buffer_slots": int(512 * fraction),
        "policy": policy,
        "tpot_ms": tpot,
        "tpot_ms_min": tpot - 1,
        "tpot_ms_max": tpot + 1,
        "tpot_vs_on_demand": ratio[0],
        "tpot_vs_on_demand_min": ratio[1],
        "tpot_vs_on_demand_max": ratio[2],
        "prefetch_on_share": None,
        **extra,
    }


def _point(
    ratios: dict[float, tuple[float, float, float]], link: float = 4.0, batch: int = 4, **extra
) -> dict:
    """A ``bench policies --json`` output: per buffer an on-demand row and an eam row with ``ratios``."""
    results = [_row(1.0, "all-resident", 5.0, (0.5, 0.5, 0.5))]
    for f, ratio in ratios.items():
        results += [
            _row(f, "on-demand+lru", 10.0, (1.0, 1.0, 1.0)),
            _row(f, "eam", 10.0 * ratio[0], ratio, **extra),
        ]
    settings = {"model": "tiny-moe", "link_gbps": link or None, "tasks": ["a", "b"], "warm_prompts": 2,
                "eval_prompts": 16, "batch": batch, "new_tokens": 8, "repeats": 3, "seed": 0,
                "load_avg_before": [0.5, 0.6, 0.7], "load_avg_after": [1.0, 0.8], "wall_s": 30.0}  # fmt: skip
    return {"settings": settings, "results": results, "verdicts": []}


def _grid(*points: dict, min_batches: int = 4) -> dict:
    return {"grid": {"min_batches": min_batches}, "points": list(points)}


def _cells(block: str, link: str, batch: int, buffer: str) -> list[str]:
    line = next(x for x in block.splitlines() if x.startswith(f"| {link} | {batch} | {buffer} |"))
    return [c.strip() for c in line.strip("|").split("|")]


# ---- the table


@pytest.mark.parametrize(
    "ratio, expected",
    [
        ((1.0, 0.98, 1.02), "met"),  # the slowest round exactly at the bound
        ((1.02, 0.99, 1.0201), "within noise"),  # the median at the bound, the slowest just above
        ((1.0201, 1.0, 1.03), "not met"),  # the median just above
        ((1.05, 1.01, 1.09), "not met"),  # the fastest round below the bound does not save it
    ],
)
def test_verdict_at_the_bound(ratio, expected):
    assert verdict(ratio[0], ratio[2]) == expected
    block = render_grid(_grid(_point({0.25: ratio})))
    assert _cells(block, "4", 4, "25%")[-1] == expected


def test_row_cells_come_from_the_json():
    block = render_grid(_grid(_point({0.1: (0.97, 0.95, 1.01)}, link=0.5, batch=1, prefetch_on_share=0.6)))
    cells = _cells(block, "0.5", 1, "10%")
    # slots, eam TPOT, on-demand TPOT, paired ratio as stored (not recomputed from the medians), share
    assert cells[3:8] == ["51", "9.70 [8.70, 10.70]", "10.00 [9.00, 11.00]", "0.970 [0.950, 1.010]", "0.60"]
    assert "arm shares" not in block  # none recorded: no column
    assert "100%" not in block  # the all-resident reference is no grid row
    assert block.startswith("**1 met, 0 within noise, 0 not met, 0 missing** (1 rows)")
    assert "fill at least 4 batches" in block


def test_arm_shares_rendered_when_present():
    point = _point({0.5: (1.0, 0.99, 1.01)}, link=32.0, batch=16, arm_shares={"on-demand": 0.25, "eam": 0.75})
    assert _cells(render_grid(_grid(point)), "32", 16, "50%")[8] == "eam 0.75, on-demand 0.25"


def test_a_missing_row_is_a_row():
    point = _point({0.1: (1.0, 0.99, 1.01)}, link=0.0, batch=1)
    point["results"].append(_row(0.5, "on-demand+lru", 10.0, (1.0, 1.0, 1.0)))  # no eam row at 50%
    block = render_grid(_grid(point))
    assert _cells(block, "off", 1, "50%")[3] == "missing (no eam row)"
    assert _cells(block, "off", 1, "50%")[-1] == "missing"
    assert "**1 met, 0 within noise, 0 not met, 1 missing** (2 rows)" in block


def test_points_of_different_workloads_are_flagged():
    ok = {0.5: (1.0, 0.99, 1.01)}
    same = render_grid(_grid(_point(ok), _point(ok, batch=16)))
    assert "differ" not in same and "`seed=0`" in same
    other = _point(ok, batch=16)
    other["settings"]["new_tokens"] = 16
    assert "**the points differ in** `new_tokens`" in render_grid(_grid(_point(ok), other))
    # the prompts per point scale with the batch (--min-batches): shown, not flagged
    scaled = _point(ok, batch=16)
    scaled["settings"]["warm_prompts"] = scaled["settings"]["eval_prompts"] = 64
    shown = render_grid(_grid(_point(ok), scaled))
    assert (
        "differ" not in shown
        and "batch 4: 2 tasks, 2 warm and 16 eval prompts; batch 16: 2 tasks, 64 warm and 64 eval" in shown
    )


def test_no_point_at_all_is_an_error():
    with pytest.raises(ValueError):
        render_grid({"grid": {}, "points": []})


# ---- the runner


def _args(**kw) -> argparse.Namespace:
    base = dict(link_gbps=[0.5, 0.0], batch=[1, 4, 16], tasks=8, warm=2, eval=2, min_batches=4, seed=3)
    return argparse.Namespace(**{**base, **kw})


def test_prompts_per_task_fill_min_batches():
    # --min-batches 4: batch 16 gets 8 warm and 8 eval prompts per task (64 each, four batches),
    # batch 4 keeps 2 (8 tasks x 2 = four batches already)
    for batch, per_task in ((16, 8), (4, 2), (1, 2)):
        one = point_args(_args(), 0.5, batch)
        assert (one.warm, one.eval, one.batch, one.link_gbps) == (per_task, per_task, batch, 0.5)
        assert one.seed == 3  # every other flag as given
    one = point_args(_args(min_batches=1), 0.5, 16)
    assert (one.warm, one.eval) == (2, 2)
    assert prompts_per_task(2, 16, 8, 0) == 2  # 0: never raised


def test_run_grid_measures_every_point_in_order():
    seen = []

    def measure(args):
        seen.append((args.link_gbps, args.batch, args.eval))
        return _point({0.5: (1.0, 1.0, 1.0)}, args.link_gbps, args.batch)

    data = run_grid(_args(), measure)
    assert seen == [(0.5, 1, 2), (0.5, 4, 2), (0.5, 16, 8), (0.0, 1, 2), (0.0, 4, 2), (0.0, 16, 8)]
    assert len(data["points"]) == 6 and data["grid"]["min_batches"] == 4
    assert data["grid"]["links_gbps"] == [0.5, 0.0] and data["grid"]["batches"] == [1, 4, 16]
    assert "6 met" in render_grid(data)


def _cli(argv: list[str]) -> dict:
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(["bench", "policies", *argv, "--json"]) == 0
    return json.loads(buf.getvalue())


def test_cli_one_point_keeps_its_json_and_several_make_a_grid(monkeypatch):
    monkeypatch.setattr(policies, "_point", lambda a: _point({0.5: (1.0, 1.0, 1.0)}, a.link_gbps, a.batch))
    one = _cli(["--link-gbps", "4", "--batch", "2"])
    assert set(one) == {"settings", "results", "verdicts"}
    grid = _cli(["--link-gbps", "4,0", "--batch", "1,2", "--min-batches", "2"])
    assert [(p["settings"]["link_gbps"], p["settings"]["batch"]) for p in grid["points"]] == [
        (4.0, 1), (4.0, 2), (None, 1), (None, 2)
    ]  # fmt: skip


@pytest.mark.parametrize("flag, value", [("--batch", "1,0"), ("--batch", "two"), ("--link-gbps", "4,x")])
def test_bad_grid_values_are_parser_errors(flag, value, capsys):
    assert main(["bench", "policies", flag, value]) == 2
    assert f"argument {flag}: '{value}'" in capsys.readouterr().err


def test_a_real_two_point_grid(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"dataset": "d", "task": "t", "prompt": f"Question {i}: what is {i} plus {i}?"} for i in range(3)]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    argv = ["--prompts", str(prompts), "--tasks", "1", "--warm", "1", "--eval", "2", "--new-tokens", "3"]
    argv += ["--fractions", "0.25", "--policies", "on-demand+lru,eam", "--repeats", "3"]
    data = _cli([*argv, "--link-gbps", "0,4", "--batch", "2"])
    assert [p["settings"]["link_gbps"] for p in data["points"]] == [None, 4.0]
    for p in data["points"]:
        assert p["settings"]["repeats"] == 3 and p["settings"]["eval_prompts"] == 2
        assert {r["policy"] for r in p["results"]} == {"all-resident", "on-demand+lru", "eam"}
    block = render_grid(data)
    assert "(2 rows)" in block and "| off | 2 | 25% |" in block and "| 4 | 2 | 25% |" in block
