"""Where ``--model`` points: a local checkpoint folder or a Hugging Face Hub repository.

How a ``--model`` value is read (:func:`resolve`):

1. A path that exists is a local folder, always, even when it also reads as ``org/name``.
2. Otherwise ``org/name`` (exactly one ``/``, both parts non-empty, letters, digits, ``-``, ``_``
   and ``.`` only, not starting with ``.``, ``/`` or ``~``) is a Hub repository id. It resolves
   through the standard Hugging Face cache (``HF_HOME``, ``HF_HUB_CACHE``) with
   ``huggingface_hub.snapshot_download``: the cached snapshot when it is there, a download of the
   files the runtime reads when it is not (``HF_TOKEN`` for gated or private repositories), and
   the cache only with ``HF_HUB_OFFLINE=1``.
3. Anything else names a local folder that does not exist: an error.

The model id a server answers to (:func:`served_name`) is the repository id for a Hub model and
for a folder inside a Hugging Face cache (``.../models--org--name/snapshots/<rev>`` is
``org/name``), else the folder's name.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from moe_runtime.errors import CheckpointError, ConfigError

#: What is downloaded for a Hub model: the top-level config, tokenizer and weight files, and chat
#: templates (``chat_template.jinja``, ``additional_chat_templates/*.jinja``). Subfolders with
#: other copies of the weights (gpt-oss's ``original/``) are left out.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja"]
IGNORE_PATTERNS = ["*/*.json", "*/*.safetensors"]

_REPO_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+")
_TRUE = {"1", "ON", "YES", "TRUE"}


class HubError(CheckpointError):
    """A Hub model cannot be resolved: not cached while offline, no such repository or revision,
    access refused, or the download failed."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A resolved ``--model``: the local folder to load, and the id to serve it under."""

    path: Path
    name: str
    repo_id: str | None = None
    revision: str | None = None


def is_repo_id(value: str) -> bool:
    """Whether ``value`` has the form of a Hub repository id (``org/name``); says nothing of
    whether a local path of that name exists (:func:`resolve` checks that first)."""
    return bool(_REPO_ID.fullmatch(value)) and ".." not in value and "--" not in value


def cache_repo_id(path: Path) -> str | None:
    """``org/name`` when ``path`` is a snapshot in a Hugging Face cache
    (``models--org--name/snapshots/<rev>``, also through a symlink), else ``None``."""
    for p in (path.absolute(), path.resolve()):
        repo = p.parent.parent.name
        if p.parent.name == "snapshots" and repo.startswith("models--") and len(repo) > len("models--"):
            return repo[len("models--") :].replace("--", "/")
    return None


def served_name(path: Path) -> str:
    """The model id a folder is served under: its repo id for a Hugging Face cache snapshot
    (:func:`cache_repo_id`), else the folder's name."""
    return cache_repo_id(path) or path.resolve().name


def resolve(model: str | Path, revision: str | None = None) -> ModelSource:
    """The local folder and served id of a ``--model`` value (rules in the module docstring).

    Raises:
        ConfigError: ``revision`` given for a local folder.
        CheckpointError: neither an existing path nor a repository id.
        HubError: the repository cannot be resolved (one line naming it, its revision and why).
    """
    text = str(model)
    path = Path(text).expanduser()
    if path.exists():
        if revision is not None:
            raise ConfigError(
                f"--revision {revision}: applies to a Hugging Face repo id, not a folder ({text})"
            )
        return ModelSource(path, served_name(path))
    if not is_repo_id(text):
        raise CheckpointError(
            f"{text}: model folder does not exist (nor is it a Hugging Face repo id org/name)"
        )
    return ModelSource(download(text, revision), text, text, revision)


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as set now."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in _TRUE


def cache_dir() -> str | None:
    """The Hub cache as the environment sets it now: ``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
    ``None`` (the library's default, ``~/.cache/huggingface/hub``)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.path.expandvars(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.path.expandvars(os.environ["HF_HOME"])), "hub")
    return None


def download(repo_id: str, revision: str | None = None) -> Path:
    """The cached snapshot folder of ``repo_id`` at ``revision`` (default branch when ``None``),
    downloaded first when it is not cached and the Hub is reachable.

    Raises:
        HubError: one line naming the repository and revision, and why.
    """
    try:
        from huggingface_hub import errors as hf
        from huggingface_hub import snapshot_download
    except ImportError:
        raise HubError(f"{repo_id}: loading a model by repo id needs the huggingface_hub package") from None

    where = f"{repo_id} (revision {revision or 'main'})"
    is_offline = offline()
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache_dir(),
            local_files_only=is_offline,
            allow_patterns=ALLOW_PATTERNS,
            ignore_patterns=IGNORE_PATTERNS,
        )
    except hf.RevisionNotFoundError:
        raise HubError(f"{where}: revision not found in the repository") from None
    except hf.GatedRepoError:
        raise HubError(
            f"{where}: access is gated; accept its terms on https://huggingface.co/{repo_id} and set "
            "HF_TOKEN (or run `hf auth login`)"
        ) from None
    except hf.RepositoryNotFoundError:
        raise HubError(
            f"{where}: repository not found on the Hugging Face Hub (if it is private, set HF_TOKEN)"
        ) from None
    except hf.LocalEntryNotFoundError as exc:
        shown = cache_dir() or "the Hugging Face cache"
        if "incomplete" in str(exc):
            why = f"the snapshot in {shown} is incomplete and the Hub cannot be reached"
        elif is_offline:
            why = f"not in {shown} and HF_HUB_OFFLINE is set; download it first with `hf download {repo_id}`"
        else:
            why = f"not in {shown} and the Hugging Face Hub cannot be reached"
        raise HubError(f"{where}: {why}") from None
    except hf.HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status in (401, 403):
            why = f"access refused (HTTP {status}); set HF_TOKEN to a token that can read it"
        else:
            why = f"the Hugging Face Hub answered {status or 'an error'}: {_first_line(exc)}"
        raise HubError(f"{where}: {why}") from None
    except hf.HFValidationError as exc:
        raise HubError(f"{where}: {_first_line(exc)}") from None
    except OSError as exc:  # disk full, permissions in the cache folder, connection dropped mid-file
        raise HubError(f"{where}: download failed ({_first_line(exc)})") from None
    return Path(folder)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
