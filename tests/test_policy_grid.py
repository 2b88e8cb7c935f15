"""``tools/policy_grid.py`` (command lines, resume, one file per point; the subprocess is mocked)
and ``tools/update_policy_grid_docs.py`` (verdicts at the 1.02 boundary, missing points, the
marked block in docs/results.md) on small hand-built ``bench policies --json`` outputs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from tool_module import TOOLS, load_tool


@pytest.fixture(scope="module")
def grid():
    return load_tool("policy_grid")


@pytest.fixture(scope="module")
def docs():
    return load_tool("update_policy_grid_docs")


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
    results = []
    for f, ratio in ratios.items():
        results += [
            _row(f, "on-demand+lru", 10.0, (1.0, 1.0, 1.0)),
            _row(f, "eam", 10.0 * ratio[0], ratio, **extra),
        ]
    settings = {"model": "tiny-moe", "link_gbps": link or None, "tasks": ["a", "b"], "warm_prompts": 2,
                "eval_prompts": 16, "batch": batch, "new_tokens": 8, "repeats": 3, "seed": 0,
                "load_avg_before": [0.5, 0.6, 0.7], "load_avg_after": [1.0, 0.8], "wall_s": 30.0}  # fmt: skip
    return {"settings": settings, "results": results, "verdicts": []}


def _cells(block: str, link: str, batch: int, buffer: str) -> list[str]:
    line = next(x for x in block.splitlines() if x.startswith(f"| {link} | {batch} | {buffer} |"))
    return [c.strip() for c in line.strip("|").split("|")]


# ---- the renderer


@pytest.mark.parametrize(
    "ratio, expected",
    [
        ((1.0, 0.98, 1.02), "met"),  # the slowest round exactly at the bound
        ((1.02, 0.99, 1.0201), "within noise"),  # the median at the bound, the slowest just above
        ((1.0201, 1.0, 1.03), "not met"),  # the median just above
        ((1.05, 1.01, 1.09), "not met"),  # the fastest round below the bound does not save it
    ],
)
def test_verdict_at_the_bound(docs, ratio, expected):
    assert docs.verdict(ratio[0], ratio[2]) == expected
    block = docs.render({(4.0, 4): _point({0.25: ratio})}, [0.25])
    assert _cells(block, "4", 4, "25%")[-1] == expected


def test_row_cells_come_from_the_json(docs):
    point = _point({0.1: (0.97, 0.95, 1.01)}, prefetch_on_share=0.6)
    block = docs.render({(0.5, 1): point}, [0.1])
    cells = _cells(block, "0.5", 1, "10%")
    # slots, eam TPOT, on-demand TPOT, paired ratio as stored (not recomputed from the medians), share
    assert cells[3:8] == ["51", "9.70 [8.70, 10.70]", "10.00 [9.00, 11.00]", "0.970 [0.950, 1.010]", "0.60"]
    assert "arm shares" not in block  # none recorded: no column
    assert "**1 met, 0 within noise, 0 not met, 0 missing** (1 rows)" in block


def test_arm_shares_rendered_when_present(docs):
    point = _point({0.5: (1.0, 0.99, 1.01)}, arm_shares={"on-demand": 0.25, "eam": 0.75})
    block = docs.render({(32.0, 16): point}, [0.5])
    assert _cells(block, "32", 16, "50%")[8] == "eam 0.75, on-demand 0.25"


def test_missing_point_and_buffer_are_rows(docs):
    points = {(0.0, 1): _point({0.1: (1.0, 0.99, 1.01)}, link=0.0, batch=1), (0.0, 16): None}
    block = docs.render(points, [0.1, 0.5])
    assert _cells(block, "off", 1, "50%")[3] == "missing (no eam row)"
    assert _cells(block, "off", 16, "10%")[3] == "missing (no file)"
    assert _cells(block, "off", 16, "10%")[-1] == "missing"
    assert "**1 met, 0 within noise, 0 not met, 3 missing** (4 rows)" in block
    settings = next(x for x in block.splitlines() if x.startswith("| off | 16 |  |"))
    assert settings.count("|") == 11  # the settings table's row for the absent point


def test_points_of_different_workloads_are_flagged(docs):
    ok = {0.5: (1.0, 0.99, 1.01)}
    same = docs.render({(4.0, 4): _point(ok), (4.0, 16): _point(ok, batch=16)}, [0.5])
    assert "differ" not in same and "`seed=0`" in same
    other = _point(ok, batch=16)
    other["settings"]["new_tokens"] = 16
    mixed = docs.render({(4.0, 4): _point(ok), (4.0, 16): other}, [0.5])
    assert "**the points differ in** `new_tokens`" in mixed
    # the prompts per point scale with the batch (policy_grid.py --min-batches): shown, not flagged
    scaled = _point(ok, batch=16)
    scaled["settings"]["warm_prompts"] = scaled["settings"]["eval_prompts"] = 64
    shown = docs.render({(4.0, 4): _point(ok), (4.0, 16): scaled}, [0.5])
    assert "differ" not in shown and "| 4 | 16 | 2 | 64 | 64 |" in shown


def test_no_point_at_all_is_an_error(docs):
    with pytest.raises(ValueError):
        docs.render({(4.0, 4): None}, [0.5])


def test_block_placed_after_policies_and_replaced_idempotently(docs, tmp_path):
    doc = tmp_path / "results.md"
    doc.write_text("# Results\n<!-- BEGIN policies -->\nold\n<!-- END policies -->\n\n## Next\n")
    folder = tmp_path / "grid"
    folder.mkdir()
    (folder / "link4-batch4.json").write_text(json.dumps(_point({0.5: (1.0, 0.99, 1.01)})))
    argv = ["--dir", str(folder), "--doc", str(doc), "--links", "4", "--batches", "4", "--fractions", "0.5"]
    assert docs.main(argv) == 0
    once = doc.read_text()
    assert once.index("<!-- END policies -->") < once.index(docs.BEGIN) < once.index(docs.END)
    assert once.index(docs.END) < once.index("## Next") and once.count(docs.BEGIN) == 1
    assert docs.main(argv) == 0
    assert doc.read_text() == once  # the same files: the same text
    (folder / "link4-batch4.json").write_text(json.dumps(_point({0.5: (1.1, 1.05, 1.2)})))
    assert docs.main(argv) == 0
    again = doc.read_text()
    assert again.count(docs.BEGIN) == 1 and "not met" in again and "## Next" in again
    assert docs.main(["--dir", str(tmp_path / "empty"), *argv[2:]]) == 2
    assert doc.read_text() == again  # nothing to render: the doc left as it is


# ---- the runner


def test_command_and_file_names(grid):
    argv = ["--tasks", "8", "--eval", "2", "--new-tokens", "4", "--min-batches", "1", "--seed", "3"]
    args, extra = grid.parse_args(argv)
    assert extra == ["--seed", "3"]  # unknown flags go to bench policies
    cmd = grid.command(0.5, 16, args, extra)
    assert cmd[:4] == ["-m", "moeserve.cli", "bench", "policies"]
    flags = dict(zip(cmd[4:-3:2], cmd[5:-3:2]))
    assert flags == {"--policies": "on-demand+lru,eam", "--fractions": "0.1,0.25,0.5", "--link-gbps": "0.5",
                     "--batch": "16", "--repeats": "3", "--tasks": "8", "--warm": "2", "--eval": "2",
                     "--new-tokens": "4"}  # fmt: skip
    assert cmd[-3:] == ["--seed", "3", "--json"]
    assert grid.command(0.0, 1, args, [])[cmd.index("--link-gbps") + 1] == "0"
    # --min-batches 4 (the default): batch 16 gets 8 warm and 8 eval prompts per task (64 each, four
    # batches), batch 4 keeps 2 (8 tasks x 2 = four batches already)
    args, _ = grid.parse_args(["--tasks", "8", "--eval", "2", "--new-tokens", "4"])
    for batch, per_task in ((16, "8"), (4, "2"), (1, "2")):
        line = grid.command(0.5, batch, args, [])
        assert line[line.index("--warm") + 1] == line[line.index("--eval") + 1] == per_task
    args, _ = grid.parse_args(["--tasks", "8", "--eval", "2", "--min-batches", "1"])
    line = grid.command(0.5, 16, args, [])
    assert line[line.index("--warm") + 1] == line[line.index("--eval") + 1] == "2"
    names = {grid.point_file(Path("d"), g, b).name for g in grid.LINKS for b in grid.BATCHES}
    assert len(names) == 12 and "linkoff-batch16.json" in names and "link0.5-batch1.json" in names


def test_too_few_eval_prompts_for_the_largest_batch(grid):
    with pytest.raises(SystemExit) as err:
        grid.parse_args(["--tasks", "2", "--eval", "2"])  # 4 prompts, batch 16
    assert err.value.code == 2


class FakeRun:
    """Stands in for subprocess.run: records the points run; fails the batch in ``fail``."""

    def __init__(self, fail: int | None = None) -> None:
        self.calls, self.fail = [], fail

    def __call__(self, cmd, **kw):
        batch = int(cmd[cmd.index("--batch") + 1])
        link = float(cmd[cmd.index("--link-gbps") + 1])
        self.calls.append((link, batch))
        assert kw["env"]["PYTHONPATH"] == str(TOOLS.parent)  # this tree's code
        if batch == self.fail:
            return subprocess.CompletedProcess(cmd, 1, "", "Traceback\nConfigError: boom\n")
        return subprocess.CompletedProcess(
            cmd, 0, json.dumps(_point({0.5: (1.0, 1.0, 1.0)}, link, batch)), ""
        )


def test_resume_skips_saved_points_and_force_reruns(grid, tmp_path, capsys):
    argv = ["--links", "4,0", "--batches", "1,4", "--tasks", "2", "--out", str(tmp_path)]
    first = FakeRun(fail=4)
    assert grid.main(argv, run=first) == 1  # a failed point: exit 1, the others still run
    assert first.calls == [(4.0, 1), (4.0, 4), (0.0, 1), (0.0, 4)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link4-batch1.json", "linkoff-batch1.json"]
    saved = json.loads((tmp_path / "linkoff-batch1.json").read_text())
    assert "--link-gbps 0 --batch 1" in saved["grid"]["command"] and saved["settings"]["batch"] == 1
    assert "ConfigError: boom" in capsys.readouterr().out
    second = FakeRun()
    assert grid.main(argv, run=second) == 0
    assert second.calls == [(4.0, 4), (0.0, 4)]  # only the points without a file
    forced = FakeRun()
    assert grid.main([*argv, "--force"], run=forced) == 0 and len(forced.calls) == 4


def test_resume_refuses_a_file_from_another_command(grid, tmp_path, capsys):
    argv = ["--links", "4", "--batches", "1", "--out", str(tmp_path)]
    assert grid.main(argv, run=FakeRun()) == 0
    other = FakeRun()
    assert grid.main([*argv, "--new-tokens", "4"], run=other) == 2
    assert other.calls == [] and "another command" in capsys.readouterr().out


def test_keep_previous_puts_the_old_table_beside_the_new(docs, tmp_path):
    doc = tmp_path / "results.md"
    doc.write_text("# Results\n<!-- END policies -->\n\n## Next\n")
    folder = tmp_path / "grid"
    folder.mkdir()
    point = folder / "link4-batch4.json"
    point.write_text(json.dumps(_point({0.5: (1.1, 1.05, 1.2)})))
    argv = ["--dir", str(folder), "--doc", str(doc), "--links", "4", "--batches", "4", "--fractions", "0.5"]
    assert docs.main([*argv, "--keep-previous", "old"]) == 2  # no table yet to keep
    assert docs.main(argv) == 0
    point.write_text(json.dumps(_point({0.5: (0.99, 0.98, 1.0)})))
    assert docs.main([*argv, "--keep-previous", "Measured at abc1234:"]) == 0
    text = doc.read_text()
    new = text[text.index(docs.BEGIN) : text.index(docs.END)]
    old = text[text.index(docs.PREV_BEGIN) : text.index(docs.PREV_END)]
    assert text.index(docs.END) < text.index(docs.PREV_BEGIN) < text.index("## Next")
    assert "**1 met, 0 within noise, 0 not met, 0 missing**" in new and "--keep-previous" not in new
    assert old.startswith(docs.PREV_BEGIN + "\nMeasured at abc1234:\n")
    assert "**0 met, 0 within noise, 1 not met, 0 missing**" in old and "1.100 [1.050, 1.200]" in old
    assert "Settings per point" not in old  # the table alone
    assert docs.main([*argv, "--keep-previous", "again"]) == 0  # replaced, not stacked
    again = doc.read_text()
    assert again.count(docs.PREV_BEGIN) == 1 and "\nagain\n" in again and "1.100" not in again
