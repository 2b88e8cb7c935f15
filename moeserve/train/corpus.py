"""Multi-domain training corpus of the bundled tiny MoE, its held-out split and the overlap check.

Four domains, chosen so that a trained router has something to specialise on (MoE-Infinity
§3.1, "group activation ... attributed to the training method of MoE models"):

- ``code`` — Python source of half of this interpreter's stdlib files (tests excluded);
- ``technical`` — technical English: the docstrings of the *other* half of the stdlib files and the
  language-reference topics of ``pydoc_data.topics`` (so no text is in both ``code`` and here);
- ``literary`` — Tiny Shakespeare (``corpus/tinyshakespeare/input.txt``);
- ``qa`` — exam-style question/answer text: MMLU test rows *after* the first
  :data:`REPLAYED_ROWS` of each subject plus the dev rows, and FLAN-v2 CoT rows after the first
  :data:`REPLAYED_ROWS` of each file. Half the rows are rendered with the chat template.

NOTE: benchmarks replay ``prompts/prompts_combined.jsonl`` and ``prompts/prompts_extra.jsonl``;
none of that text may be trained on. Two checks enforce it: (1) row ids — the replayed files name
MMLU rows ``mmlu/<subject>/test/<i>`` and FLAN rows ``flan_cot/cot_<set>/<i>``; the ids we use
must be disjoint from them, else :class:`~moe_runtime.errors.ConfigError`; (2) text — any document
(of any domain, train or held-out) sharing a word 13-gram (the GPT-3 contamination test) with a
replayed prompt is dropped, and the final split is re-checked to have zero such overlap.

The held-out split is by *source* (a stdlib file, a pydoc topic, a block of 5 Shakespeare
passages, a QA row), chosen by a salted hash independent of the training seed, so it is stable.
"""

from __future__ import annotations

import ast
import csv
import hashlib
import inspect
import json
import re
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from moe_runtime.errors import ConfigError
from moeserve.train.tokenizer import render_chat

DOMAINS: tuple[str, ...] = ("code", "technical", "literary", "qa")
REPLAYED_FILES: tuple[str, ...] = ("prompts/prompts_combined.jsonl", "prompts/prompts_extra.jsonl")
REPLAYED_ROWS = 20  # prompts_combined replays the first 20 MMLU test rows per subject / FLAN rows per set
NGRAM = 13  # words; shared n-grams of this length count as overlap
SPLIT_SALT = "moeserve-tiny-moe-split-v1"
CHUNK_CHARS = 2000  # documents are cut into pieces of about this many characters
MIN_DOC_CHARS = 120
HELDOUT_PERMILLE = 50  # share of sources held out, in 1/1000
FLAN_ROWS_PER_SET = 1500  # FLAN-v2 CoT rows used per set (after the replayed ones)
SHAKESPEARE_GROUP = 5  # consecutive Shakespeare pieces sharing one split source
CHAT_PERMILLE = 500  # share of QA rows rendered with the chat template, in 1/1000
_EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3", "turtledemo"}
_WORD = re.compile(r"\w+")


@dataclass(frozen=True, slots=True)
class Doc:
    """One training document: ``source`` is the unit the held-out split is drawn over."""

    domain: str
    source: str
    text: str


@dataclass(slots=True)
class CorpusSplit:
    """Train and held-out documents per domain, plus provenance counts for the model card."""

    train: dict[str, list[Doc]]
    heldout: dict[str, list[Doc]]
    stats: dict[str, dict[str, int]] = field(default_factory=dict)


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def default_data_dir() -> Path:
    """``../shared/data`` relative to the repository (where the raw data sets live)."""
    return (repo_root().parent / "shared" / "data").resolve()


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _bucket(key: str, salt: str = SPLIT_SALT) -> int:
    """Stable pseudo-random integer in [0, 1000) for ``key``."""
    return int(hashlib.sha1(f"{salt}:{key}".encode()).hexdigest()[:8], 16) % 1000


def _chunks(blocks: Iterable[str], limit: int = CHUNK_CHARS) -> Iterator[str]:
    """Greedily join consecutive text blocks into pieces of at most ~``limit`` characters."""
    cur: list[str] = []
    size = 0
    for block in blocks:
        if cur and size + len(block) > limit:
            yield "".join(cur).strip("\n")
            cur, size = [], 0
        cur.append(block)
        size += len(block)
    if cur:
        yield "".join(cur).strip("\n")


# --- domains -------------------------------------------------------------------------------------


def stdlib_files(root: Path | None = None) -> list[tuple[str, Path]]:
    """Sorted ``(relative path, path)`` of stdlib ``.py`` files, test packages excluded."""
    root = root or stdlib_dir()
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if not _EXCLUDED_DIRS.intersection(path.relative_to(root).parts[:-1]):
            out.append((rel, path))
    return sorted(out)


def _is_code_file(rel: str) -> bool:
    """Half the stdlib files feed ``code``; the other half's docstrings feed ``technical``."""
    return _bucket(rel, "moeserve-tiny-moe-stdlib") < 500


def code_docs(root: Path | None = None) -> list[Doc]:
    """Python source, cut at top-level ``def``/``class`` boundaries into ~2 KB pieces."""
    docs = []
    for rel, path in stdlib_files(root):
        if not _is_code_file(rel):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        blocks = re.split(r"(?m)^(?=(?:def |class |@|async def ))", text)
        docs += [Doc("code", f"stdlib/{rel}", c) for c in _chunks(blocks) if len(c) >= MIN_DOC_CHARS]
    return docs


def _docstrings(text: str) -> list[str]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    nodes = [tree] + [
        n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    ]
    out = []
    for node in nodes:
        doc = ast.get_docstring(node, clean=False)
        if doc and len(doc) >= 200:
            out.append(inspect.cleandoc(doc) + "\n\n")
    return out


def technical_docs(root: Path | None = None) -> list[Doc]:
    """Docstrings (>= 200 chars) of the non-``code`` stdlib files and the pydoc topics."""
    import pydoc_data.topics

    docs = []
    for rel, path in stdlib_files(root):
        if _is_code_file(rel):
            continue
        strings = _docstrings(path.read_text(encoding="utf-8", errors="replace"))
        docs += [
            Doc("technical", f"docstrings/{rel}", c) for c in _chunks(strings) if len(c) >= MIN_DOC_CHARS
        ]
    for name, body in sorted(pydoc_data.topics.topics.items()):
        paragraphs = [p + "\n\n" for p in body.split("\n\n")]
        docs += [
            Doc("technical", f"pydoc_topics/{name}", c)
            for c in _chunks(paragraphs)
            if len(c) >= MIN_DOC_CHARS
        ]
    return docs


def literary_docs(data_dir: Path) -> list[Doc]:
    """Tiny Shakespeare cut into ~1.5 KB runs of speeches; :data:`SHAKESPEARE_GROUP` consecutive runs
    share a source."""
    text = (data_dir / "corpus" / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
    speeches = [s + "\n\n" for s in text.split("\n\n")]
    pieces = list(_chunks(speeches, limit=1500))  # characters
    return [
        Doc("literary", f"shakespeare/{i // SHAKESPEARE_GROUP}", c)
        for i, c in enumerate(pieces)
        if len(c) >= MIN_DOC_CHARS
    ]


def _qa_text(source: str, question: str, answer: str) -> str:
    """Plain ``Question:/Answer:`` text, or (for half the rows, by hash) a chat exchange."""
    if _bucket(source, "moeserve-tiny-moe-chat") < CHAT_PERMILLE:
        # The packer appends EOS after every document, so the chat text ends right after the answer.
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        return render_chat(messages, eos_token="").rstrip("\n")
    return f"Question: {question}\nAnswer: {answer}"


def qa_docs(data_dir: Path, flan_rows_per_set: int = FLAN_ROWS_PER_SET) -> list[Doc]:
    """MMLU test rows >= :data:`REPLAYED_ROWS` + dev rows, and FLAN-v2 CoT rows after the first
    :data:`REPLAYED_ROWS` (at most ``flan_rows_per_set`` per set). Sources are the row ids the
    replayed prompt files use, so :func:`check_row_ids` can compare them."""
    docs = []
    raw = data_dir / "prompts" / "raw"
    for split in ("test", "dev"):
        for path in sorted((raw / "mmlu" / split).glob(f"*_{split}.csv")):
            subject = path.name[: -len(f"_{split}.csv")]
            with path.open(newline="", encoding="utf-8") as f:
                for i, row in enumerate(csv.DictReader(f)):
                    if split == "test" and i < REPLAYED_ROWS:
                        continue
                    choices = "\n".join(f"{'ABCD'[k]}. {row[f'choice{k}']}" for k in range(4))
                    question = f"{row['question']}\n{choices}"
                    answer = f"The answer is {'ABCD'[int(row['answer'])]}."
                    src = f"mmlu/{subject}/{split}/{i}"
                    docs.append(Doc("qa", src, _qa_text(src, question, answer)))
    for path in sorted((raw / "flan_v2" / "cot_data").glob("*_train.jsonl")):
        name = path.name[: -len("_train.jsonl")]
        with path.open(encoding="utf-8") as f:
            for i, line in enumerate(f):
                if i < REPLAYED_ROWS:
                    continue
                if i >= REPLAYED_ROWS + flan_rows_per_set:
                    break
                row = json.loads(line)
                answer = f"{row['rationale'].strip()} So the answer is {row['answer'].strip()}."
                src = f"flan_cot/cot_{name}/{i}"
                docs.append(Doc("qa", src, _qa_text(src, row["question"].strip(), answer)))
    return docs


# --- overlap with the replayed benchmark prompts -------------------------------------------------


def replayed_prompts(data_dir: Path) -> list[dict]:
    """Rows of the prompt files the benchmarks replay (never trained on)."""
    rows = []
    for rel in REPLAYED_FILES:
        with (data_dir / rel).open(encoding="utf-8") as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return rows


def ngrams(text: str, n: int = NGRAM) -> set[int]:
    """Hashes of the lower-cased word ``n``-grams of ``text`` (``\\w+`` words)."""
    words = _WORD.findall(text.lower())
    return {hash(tuple(words[i : i + n])) for i in range(len(words) - n + 1)}


class OverlapIndex:
    """Word 13-grams of the replayed prompts; :meth:`overlaps` tells whether a text shares one."""

    def __init__(self, prompts: list[dict]) -> None:
        self.grams: set[int] = set()
        for row in prompts:
            self.grams |= ngrams(row["prompt"])

    def overlaps(self, text: str) -> bool:
        words = _WORD.findall(text.lower())
        grams = self.grams
        return any(hash(tuple(words[i : i + NGRAM])) in grams for i in range(len(words) - NGRAM + 1))


def check_row_ids(docs: list[Doc], prompts: list[dict]) -> None:
    """Raise if a QA document comes from a row the replayed prompt files use (by row id).

    Raises:
        ConfigError: naming the first shared row id.
    """
    replayed = {row.get("id") for row in prompts}
    shared = sorted({d.source for d in docs} & replayed)
    if shared:
        raise ConfigError(f"training corpus reuses {len(shared)} replayed prompt rows, e.g. {shared[0]!r}")


def build_corpus(
    data_dir: Path | None = None, heldout_permille: int = HELDOUT_PERMILLE, max_train_chars: int = 6_000_000
) -> CorpusSplit:
    """Build all domains, drop replayed-prompt overlap, split train / held-out by source.

    Args:
        data_dir: ``shared/data`` folder (default :func:`default_data_dir`).
        heldout_permille: share of sources held out, in 1/1000.
        max_train_chars: per-domain cap on training text (a stable hash order picks what stays).

    Raises:
        ConfigError: ``data_dir`` is missing or the corpus overlaps the replayed prompts.
    """
    data_dir = Path(data_dir or default_data_dir())
    if not (data_dir / REPLAYED_FILES[0]).exists():
        raise ConfigError(f"{data_dir}: no {REPLAYED_FILES[0]}; pass --data-dir pointing at shared/data")
    prompts = replayed_prompts(data_dir)
    index = OverlapIndex(prompts)
    by_domain = {
        "code": code_docs(),
        "technical": technical_docs(),
        "literary": literary_docs(data_dir),
        "qa": qa_docs(data_dir),
    }
    check_row_ids(by_domain["qa"], prompts)
    split = CorpusSplit(train={}, heldout={})
    for domain, docs in by_domain.items():
        kept = [d for d in docs if not index.overlaps(d.text)]
        held = [d for d in kept if _bucket(d.source) < heldout_permille]
        train = sorted(
            (d for d in kept if _bucket(d.source) >= heldout_permille),
            key=lambda d: _bucket(d.source + d.text[:64], "moeserve-tiny-moe-cap"),
        )
        capped, total = [], 0
        for d in train:
            if total >= max_train_chars:
                break
            capped.append(d)
            total += len(d.text)
        split.train[domain], split.heldout[domain] = capped, held
        split.stats[domain] = {
            "docs_built": len(docs),
            "docs_dropped_overlap": len(docs) - len(kept),
            "train_docs": len(capped),
            "train_chars": total,
            "train_sources": len({d.source for d in capped}),
            "heldout_docs": len(held),
            "heldout_chars": sum(len(d.text) for d in held),
            "heldout_sources": len({d.source for d in held}),
        }
    assert_no_overlap(split, index)
    return split


def assert_no_overlap(split: CorpusSplit, index: OverlapIndex) -> None:
    """Final check: no train or held-out document shares a 13-gram with a replayed prompt.

    Raises:
        ConfigError: naming the first offending document's source.
    """
    for docs in (*split.train.values(), *split.heldout.values()):
        for d in docs:
            if index.overlaps(d.text):
                raise ConfigError(f"corpus document {d.source!r} overlaps a replayed benchmark prompt")
