"""Prompt mix: tasks drawn uniformly, prompts cut or extended to a target token length.

MoE-Infinity §7.1 emulates "a generic ChatBot service": clients pick prompts uniformly from all LLM
tasks of several datasets. The input is JSONL, one object per line with string fields ``dataset``,
``task`` and ``prompt`` (other fields are ignored), e.g. ``shared/data/prompts/prompts_combined.jsonl``.

NOTE: to draw one prompt, pick a ``(dataset, task)`` pair uniformly, then a prompt of that task
uniformly (so a task with 5 prompts is as likely as one with 20). To reach a trace's
``ContextTokens``, further prompts drawn the same way are appended (joined by a blank line), and the
text is then cut to exactly the target length under the token counter. Token lengths come from a
``tokenizers`` ``tokenizer.json`` when one is given (the server's own tokenizer, so the server sees
about the length asked for), else from a chars-per-token estimate (default 4.0 characters per
token, the usual figure for English BPE vocabularies; small vocabularies have fewer).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from clients.errors import ClientError

JOINER = "\n\n"
DEFAULT_CHARS_PER_TOKEN = 4.0


@dataclass(slots=True, frozen=True)
class PromptRecord:
    """One prompt of the mix (``dataset``, ``task``, ``prompt`` text, optional ``id``)."""

    dataset: str
    task: str
    prompt: str
    id: str | None = None


@dataclass(slots=True, frozen=True)
class SampledPrompt:
    """A prompt ready to send: text plus where its first piece came from.

    Attributes:
        text: the prompt text.
        dataset, task, id: of the first prompt the text starts with.
        pieces: how many prompts were joined to reach the length.
        est_tokens: length of ``text`` under the token counter, tokens.
    """

    text: str
    dataset: str
    task: str
    id: str | None
    pieces: int
    est_tokens: int


class TokenCounter(Protocol):
    """Counts and cuts text in tokens."""

    def count(self, text: str) -> int:
        """Number of tokens in ``text``."""
        ...

    def truncate(self, text: str, n: int) -> str:
        """The longest prefix of ``text`` with at most ``n`` tokens."""
        ...


class CharEstimate:
    """Token counter that assumes ``chars_per_token`` characters per token."""

    def __init__(self, chars_per_token: float = DEFAULT_CHARS_PER_TOKEN) -> None:
        if not chars_per_token > 0:
            raise ClientError(f"--chars-per-token must be > 0, got {chars_per_token}")
        self.chars_per_token = chars_per_token

    def count(self, text: str) -> int:
        return int(round(len(text) / self.chars_per_token))

    def truncate(self, text: str, n: int) -> str:
        return text[: int(n * self.chars_per_token)]


class HFTokenizer:
    """Token counter over a ``tokenizers`` ``tokenizer.json`` (a file, or a folder holding one)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        file = path / "tokenizer.json" if path.is_dir() else path
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as exc:  # the library raises plain Exception subclasses
            raise ClientError(f"{file}: cannot load tokenizer ({exc})") from None

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)

    def truncate(self, text: str, n: int) -> str:
        enc = self._tok.encode(text, add_special_tokens=False)
        if len(enc.ids) <= n:
            return text
        return text[: enc.offsets[n][0]] if n > 0 else ""


def load_prompts(path: Path) -> list[PromptRecord]:
    """Read a prompt JSONL file.

    Raises:
        ClientError: missing file, a line that is not a JSON object, a missing or non-string
            ``dataset``/``task``/``prompt``, an empty prompt, or no prompts; names file and line.
    """
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ClientError(f"{path}: cannot open prompts ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ClientError(f"{path}: not UTF-8 text ({exc.reason})") from None
    out: list[PromptRecord] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ClientError(f"{path}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise ClientError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
        for key in ("dataset", "task", "prompt"):
            if not isinstance(obj.get(key), str):
                raise ClientError(f"{path}:{lineno}: field {key!r} missing or not a string")
        if not obj["prompt"].strip():
            raise ClientError(f"{path}:{lineno}: empty prompt")
        pid = obj.get("id")
        out.append(
            PromptRecord(obj["dataset"], obj["task"], obj["prompt"], None if pid is None else str(pid))
        )
    if not out:
        raise ClientError(f"{path}: no prompts")
    return out


class PromptSampler:
    """Draws prompts uniformly across tasks and fits them to a token length.

    Args:
        prompts: the mix (from :func:`load_prompts`).
        counter: token counter (:class:`HFTokenizer` or :class:`CharEstimate`).
        seed: RNG seed; the same seed and call sequence give the same prompts.
    """

    def __init__(self, prompts: list[PromptRecord], counter: TokenCounter, seed: int = 0) -> None:
        if not prompts:
            raise ClientError("no prompts to sample from")
        by_task: dict[tuple[str, str], list[PromptRecord]] = {}
        for p in prompts:
            by_task.setdefault((p.dataset, p.task), []).append(p)
        self.tasks: list[tuple[str, str]] = sorted(by_task)
        self._by_task = by_task
        self.counter = counter
        self._rng = random.Random(seed)
        self._tokens: dict[str, int] = {}

    def draw(self) -> PromptRecord:
        """One prompt: a task uniformly, then a prompt of that task uniformly."""
        task = self.tasks[self._rng.randrange(len(self.tasks))]
        group = self._by_task[task]
        return group[self._rng.randrange(len(group))]

    def _count(self, text: str) -> int:
        n = self._tokens.get(text)
        if n is None:
            n = self._tokens[text] = self.counter.count(text)
        return n

    def sample(self, target_tokens: int | None) -> SampledPrompt:
        """A prompt of about ``target_tokens`` tokens (``None`` = one prompt as drawn).

        Pieces are appended until their summed lengths reach the target; the joined text is then
        cut to ``target_tokens`` under the counter (at least one token is always kept).
        """
        first = self.draw()
        parts = [first.prompt]
        if target_tokens is None:
            return SampledPrompt(
                first.prompt, first.dataset, first.task, first.id, 1, self._count(first.prompt)
            )
        target = max(1, target_tokens)
        total = self._count(first.prompt)
        while total < target:
            nxt = self.draw().prompt
            parts.append(nxt)
            total += self._count(nxt) + 1
        text = self.counter.truncate(JOINER.join(parts), target) or first.prompt[:1]
        return SampledPrompt(text, first.dataset, first.task, first.id, len(parts), self.counter.count(text))

    def fit(self, p: SampledPrompt, max_tokens: int) -> SampledPrompt:
        """``p`` cut to at most ``max_tokens`` tokens (unchanged when already within)."""
        if p.est_tokens <= max_tokens:
            return p
        text = self.counter.truncate(p.text, max(1, max_tokens)) or p.text[:1]
        return SampledPrompt(text, p.dataset, p.task, p.id, p.pieces, self.counter.count(text))
