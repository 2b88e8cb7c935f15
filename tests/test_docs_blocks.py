"""The generated blocks of the docs (``tools/docs.py``): every block of the registry sits once in its
doc and every marked block is registered; a block with committed data renders stably and equals its
doc (``--check``); a block without data is left exactly as written; re-rendering removes nothing."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def load_docs_tool():
    """``tools/docs.py`` as a module (registered in ``sys.modules``: its dataclass needs that)."""
    name = "moeserve_tools_docs"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "tools" / "docs.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="module")
def docs():
    return load_docs_tool()


def _with_data(docs) -> list[str]:
    return [n for n in docs.BLOCKS if docs.data_path(n).exists()]


def test_every_registered_block_is_in_its_doc_once(docs) -> None:
    for name, block in docs.BLOCKS.items():
        text = (REPO / block.doc).read_text(encoding="utf-8")
        assert text.count(docs._begin(name)) == 1, f"{block.doc}: {docs._begin(name)} not there exactly once"
        assert text.count(docs._end(name)) == 1, f"{block.doc}: {docs._end(name)} not there exactly once"
        assert text.index(docs._begin(name)) < text.index(docs._end(name)), name


def test_every_marked_block_is_registered(docs) -> None:
    found = docs.doc_markers()
    unregistered = sorted(set(found) - set(docs.BLOCKS))
    assert not unregistered, f"not in tools/docs.py BLOCKS: {unregistered}"
    for name, where in found.items():
        assert where == [docs.BLOCKS[name].doc], f"{name}: in {where}, registered in {docs.BLOCKS[name].doc}"


def test_every_block_shows_its_command(docs) -> None:
    """A block shows the command that measures it, as the registry runs it (a block without data too,
    whose figures say which commit they were measured at)."""
    for name, block in docs.BLOCKS.items():
        body = docs.block_text((REPO / block.doc).read_text(encoding="utf-8"), name)
        assert body is not None, f"{block.doc} has no block {name}"
        assert f"```bash\n{block.command}\n```" in body, f"{name}: the block does not show its command"
        assert re.search(r"commit `[0-9a-f]{7}", body), f"{name}: the block names no commit"
        assert f"python tools/docs.py --run {name}" in body, f"{name}: no word on measuring it again"


def test_data_records_are_complete_and_current(docs) -> None:
    for name in _with_data(docs):
        data = json.loads(docs.data_path(name).read_text())
        assert {"block", "command", "commit", "host", "date", "result"} <= set(data), name
        assert data["block"] == name
        assert data["command"] == docs.BLOCKS[name].command, f"{name}: measured by another command; --run it"


def test_rendering_is_stable(docs) -> None:
    for name in _with_data(docs):
        data = json.loads(docs.data_path(name).read_text())
        first = docs.render_block(name, data)
        assert first == docs.render_block(name, json.loads(json.dumps(data))), name
        text = (REPO / docs.BLOCKS[name].doc).read_text(encoding="utf-8")
        once = docs.replace_block(text, name, first)
        assert docs.replace_block(once, name, first) == once, name


def test_check_passes(docs, capsys) -> None:
    assert docs.main(["--check"]) == 0, capsys.readouterr().err


@pytest.fixture
def tree(tmp_path, docs, monkeypatch):
    """A copy of README.md, docs/ and docs/data/ that ``tools/docs.py`` works on instead of the repo."""
    root = tmp_path / "repo"
    shutil.copytree(REPO / "docs", root / "docs")
    shutil.copy2(REPO / "README.md", root / "README.md")
    monkeypatch.setattr(docs, "ROOT", root)
    monkeypatch.setattr(docs, "DATA", root / "docs" / "data")
    return root


def _headings(text: str) -> list[str]:
    return re.findall(r"^#+ .+$", text, re.M)


def test_a_block_without_data_is_left_untouched(docs, tree, capsys) -> None:
    for name in _with_data(docs):
        (tree / "docs" / "data" / f"{name}.json").unlink()
    before = {p: p.read_text() for p in (tree / "docs").glob("*.md")}
    assert docs.main([]) == 0
    assert {p: p.read_text() for p in before} == before
    err = capsys.readouterr().err
    for name in docs.BLOCKS:
        assert f"{name}: left as it is" in err


def test_rendering_removes_no_section(docs, tree) -> None:
    """Re-rendering every block with data (here each stamped with another date) keeps every heading
    and every block of every doc."""
    for name in _with_data(docs):
        path = tree / "docs" / "data" / f"{name}.json"
        data = json.loads(path.read_text())
        path.write_text(json.dumps(data | {"date": "2000-01-01"}))
    before = {p: p.read_text() for p in (tree / "docs").glob("*.md")}
    assert docs.main([]) == 0
    for p, text in before.items():
        after = p.read_text()
        assert _headings(after) == _headings(text), p.name
        assert docs.MARKER.findall(after) == docs.MARKER.findall(text), p.name
    if _with_data(docs):
        assert any("2000-01-01" in p.read_text() for p in before)


def test_json_documents(docs) -> None:
    out = 'wrote 4 requests\n{\n "a": 1\n}\nmore text {not json}\n[1, 2]\n{"b": {"c": [3]}}\n'
    assert docs.json_documents(out) == [{"a": 1}, [1, 2], {"b": {"c": [3]}}]
    assert docs.json_documents("no json here\n") == []


def test_import_wraps_a_bare_json(docs, tree, tmp_path) -> None:
    name = next(iter(docs.BLOCKS))
    bare = tmp_path / "bench.json"
    bare.write_text(json.dumps({"settings": {}, "results": []}))
    with pytest.raises(SystemExit):  # where it ran must be said
        docs.import_file(name, bare, None, None, None)
    data = docs.import_file(name, bare, "abc1234", "NVIDIA H100", "2030-01-02")
    assert data["commit"] == "abc1234" and data["host"] == "NVIDIA H100" and data["date"] == "2030-01-02"
    assert data["command"] == docs.BLOCKS[name].command and data["result"] == {"settings": {}, "results": []}
    assert json.loads((tree / "docs" / "data" / f"{name}.json").read_text()) == data
