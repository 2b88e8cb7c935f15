"""``--model org/name`` through the Hugging Face cache, offline: a cache laid out here, as
``hf download`` leaves it (``models--org--name/{blobs,refs,snapshots}``, files linked to blobs)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from serve_helpers import free_port, wait_healthy

from moe_runtime import hub
from moe_runtime.errors import CheckpointError, ConfigError
from moeserve.cli import build_parser, main
from moeserve.commands.common import model_source
from server.runner import MODEL_EXIT

REPO_ID = "org/name"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out_cache(cache: Path, checkpoint: Path, repo_id: str = REPO_ID, commit: str = COMMIT) -> Path:
    """``checkpoint``'s files as a snapshot of ``repo_id`` at ``commit`` (branch ``main``) in the
    Hub cache folder ``cache``; the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted(checkpoint.iterdir()):
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture()
def hf_env(tmp_path, monkeypatch) -> dict[str, str]:
    """An offline Hugging Face setup under ``tmp_path`` (no token, no network)."""
    env = {
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for key in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(key, raising=False)
    return env


@pytest.fixture()
def snapshot(hf_env, tiny_qwen3) -> Path:
    return lay_out_cache(Path(hf_env["HF_HUB_CACHE"]), tiny_qwen3)


def parse(*argv: str):
    return build_parser().parse_args(["generate", "--prompt", "x", *argv])


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moeserve: error: ") and "Traceback" not in err, err
    return lines[0]


# ---------------------------------------------------------------- path or repo id
@pytest.mark.parametrize(
    ("value", "is_id"),
    [
        ("Qwen/Qwen3-30B-A3B", True),
        ("openai/gpt-oss-20b", True),
        ("deepseek-ai/DeepSeek-V2-Lite", True),
        ("org/name.v1_2", True),
        ("name", False),  # a bare name is a folder (its own error when missing)
        ("./org/name", False),
        ("/org/name", False),
        ("~/org/name", False),
        ("org/name/", False),
        ("a/b/c", False),
        (".hidden/name", False),
        ("org/na--me", False),
        ("org/../name", False),
        ("org/name with space", False),
    ],
)
def test_is_repo_id(value, is_id):
    assert hub.is_repo_id(value) is is_id


def test_served_name(tmp_path, snapshot):
    assert hub.served_name(snapshot) == REPO_ID
    link = tmp_path / "link"
    link.symlink_to(snapshot)
    assert hub.served_name(link) == REPO_ID  # a link to a snapshot: still the repo id
    plain = tmp_path / "my-model"
    plain.mkdir()
    assert hub.served_name(plain) == "my-model"
    assert hub.served_name(Path("models--gpt2/snapshots") / COMMIT) == "gpt2"  # no org


def test_repo_id_resolves_through_the_cache(snapshot):
    source = model_source(parse("--model", REPO_ID))
    assert source == hub.ModelSource(snapshot, REPO_ID, REPO_ID, None)
    assert model_source(parse("--model", REPO_ID, "--revision", COMMIT)).path == snapshot
    assert model_source(parse("--model", REPO_ID, "--revision", "main")).path == snapshot


def test_a_cache_snapshot_given_as_a_path_is_served_as_its_repo_id(snapshot):
    source = model_source(parse("--model", str(snapshot)))
    assert source.path == snapshot and source.name == REPO_ID


def test_an_existing_folder_wins_over_a_repo_id(snapshot, tiny_qwen3, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_qwen3, tmp_path / "org" / "name")
    source = model_source(parse("--model", REPO_ID))
    assert source.path == Path(REPO_ID) and source.repo_id is None and source.name == "name"
    with pytest.raises(ConfigError, match="--revision v2: applies to a Hugging Face repo id"):
        model_source(parse("--model", REPO_ID, "--revision", "v2"))


def test_default_model_and_revision_alone(hf_env):
    assert model_source(parse()).name == "tiny-moe"
    with pytest.raises(ConfigError, match="--revision needs a Hugging Face repo id"):
        model_source(parse("--revision", "main"))


def test_missing_folder_that_is_no_repo_id(hf_env, tmp_path):
    with pytest.raises(CheckpointError, match="model folder does not exist"):
        model_source(parse("--model", str(tmp_path / "nope")))


# ---------------------------------------------------------------- errors
def test_not_cached_offline(hf_env, capsys):
    rc = main(["generate", "--model", "org/missing", "--prompt", "x"])
    line = one_line(capsys.readouterr().err)
    assert rc == 2
    assert "org/missing (revision main)" in line and "HF_HUB_OFFLINE" in line
    assert "hf download org/missing" in line


def test_revision_not_cached_offline(snapshot, capsys):
    assert main(["generate", "--model", REPO_ID, "--revision", "v9", "--prompt", "x"]) == 2
    line = one_line(capsys.readouterr().err)
    assert f"{REPO_ID} (revision v9)" in line and "HF_HUB_OFFLINE" in line


def _http_error(cls, status: int = 404):
    response = SimpleNamespace(status_code=status, headers={}, request=None)
    return cls("remote says no\nsecond line", response=response)


@pytest.mark.parametrize(
    ("error", "needles"),
    [
        ("RepositoryNotFoundError", ["repository not found", "HF_TOKEN"]),
        ("GatedRepoError", ["gated", "https://huggingface.co/org/name", "HF_TOKEN"]),
        ("RevisionNotFoundError", ["revision not found"]),
        ("HfHubHTTPError:401", ["access refused (HTTP 401)", "HF_TOKEN"]),
        ("HfHubHTTPError:500", ["answered 500", "remote says no"]),
    ],
)
def test_hub_errors_are_one_line(hf_env, monkeypatch, capsys, error, needles):
    """What the Hub answers online, as it reaches the user (the download itself is stubbed)."""
    import huggingface_hub
    from huggingface_hub import errors

    name, _, status = error.partition(":")
    exc = _http_error(getattr(errors, name), int(status or 404))

    def fail(*args, **kwargs):
        raise exc

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert main(["generate", "--model", REPO_ID, "--revision", "v2", "--prompt", "x"]) == 2
    line = one_line(capsys.readouterr().err)
    assert f"{REPO_ID} (revision v2)" in line
    for needle in needles:
        assert needle in line, (needle, line)


def test_download_arguments(hf_env, monkeypatch, tmp_path):
    """Online: the cache, the patterns and the revision reach ``snapshot_download``."""
    import huggingface_hub

    seen = {}

    def fake(repo_id, **kwargs):
        seen.update(kwargs, repo_id=repo_id)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_HUB_CACHE")
    assert hub.download(REPO_ID, "v2") == tmp_path
    assert seen["repo_id"] == REPO_ID and seen["revision"] == "v2" and seen["local_files_only"] is False
    assert seen["cache_dir"] == os.path.join(hf_env["HF_HOME"], "hub")  # HF_HOME/hub without HF_HUB_CACHE
    assert {"*.json", "*.safetensors", "*.jinja"} <= set(seen["allow_patterns"])
    assert "*/*.safetensors" in seen["ignore_patterns"]  # gpt-oss's original/ copy stays on the Hub


# ---------------------------------------------------------------- serve
def test_serve_of_a_repo_not_cached_exits_with_the_model_status(hf_env, capsys):
    assert main(["serve", "--model", "org/missing", "--port", "0"]) == MODEL_EXIT
    assert "org/missing (revision main)" in one_line(capsys.readouterr().err)


@pytest.mark.parametrize("revision", [None, COMMIT])
def test_serve_a_cached_repo_by_id(snapshot, hf_env, revision):
    port = free_port()
    cmd = [sys.executable, "-m", "moeserve", "serve", "--model", REPO_ID, "--port", str(port)]
    cmd += ["--log-level", "warning", "--max-wait-ms", "0", "--enforce-eager"]
    cmd += ["--revision", revision] if revision else []
    env = {**os.environ, **hf_env}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, 60)
        models = httpx.get(base + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [REPO_ID]
        body = {"model": REPO_ID, "prompt": "def add", "max_tokens": 2}
        assert httpx.post(base + "/v1/completions", json=body, timeout=30).status_code == 200
        assert httpx.get(f"{base}/v1/models/{REPO_ID}", timeout=10).status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)


def test_settings_lines_show_a_cached_model_by_its_repo_id(snapshot):
    from moe_runtime.paths import shown_path

    assert shown_path(snapshot) == REPO_ID
