"""``tools/predictor_precision.py``: each predictor of the ``eam`` plan scored against the next
layer's routing in the runtime, on a small workload of the bundled model."""

from __future__ import annotations

import json

import pytest

from tests.tool_module import load_tool

pp = load_tool("predictor_precision")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rows = [
        {"dataset": "d", "task": "t", "prompt": f"Question {i}: what is {i} times {i + 1}?"} for i in range(4)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _args(prompts) -> list[str]:
    workload = ["--tasks", "1", "--warm", "2", "--eval", "2", "--batch", "2", "--new-tokens", "4"]
    return ["--prompts", str(prompts), *workload]


def test_rows_are_counts_of_guesses_checked_against_routing(prompts, capsys) -> None:
    assert pp.main([*_args(prompts), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["rows"]
    assert set(rows) == set(pp.PREDICTORS)
    look, chance = rows["lookahead"], rows["chance"]
    assert look["guessed"] > 0 and look["used"] > 0
    # every predictor that guessed was scored at the same layers as the random one, which always guesses
    assert chance["guessed"] >= max(r["guessed"] for r in rows.values())
    for r in rows.values():
        assert 0 <= r["hits"] <= min(r["guessed"], r["used"])
        if r["guessed"]:
            assert r["precision"] == r["hits"] / r["guessed"] and r["recall"] == r["hits"] / r["used"]
    assert out["settings"]["batch"] == 2 and out["settings"]["router_lookahead"] == 1
    # deterministic: a guess does not depend on the buffer, the link or timing
    assert pp.main([*_args(prompts), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == rows


def test_doc_block_is_rewritten_in_place(prompts, tmp_path, monkeypatch, capsys) -> None:
    doc = tmp_path / "results.md"
    begin, end = "<!-- BEGIN predictor-precision -->", "<!-- END predictor-precision -->"
    doc.write_text(f"before\n{begin}\nold\n{end}\nafter\n")
    monkeypatch.setattr(pp, "DOC", doc)
    assert pp.main([*_args(prompts), "--doc"]) == 0
    text = doc.read_text()
    assert text.startswith(f"before\n{begin}\n| predictor") and text.endswith(f"{end}\nafter\n")
    assert "old" not in text and "| router lookahead alone |" in text
    doc.write_text("no markers\n")
    with pytest.raises(SystemExit, match="no predictor-precision block"):
        pp.main([*_args(prompts), "--doc"])
