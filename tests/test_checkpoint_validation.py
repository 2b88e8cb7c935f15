"""A checkpoint folder is untrusted input: each bad one gives one line naming the field or tensor,
exit 2, before anything large is allocated (docs/operations.md, "Checkpoint validation")."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_cli_errors import _rewrite, assert_one_line, run_cli

from moe_runtime import memory_plan
from moe_runtime.config import RuntimeConfig
from moe_runtime.engine.engine import LLMEngine
from moe_runtime.errors import InsufficientMemoryError
from moe_runtime.loader import load_checkpoint, read_model_config
from moe_runtime.memory_plan import check_memory, host_available, plan_memory
from server.runner import MODEL_EXIT

EXPERT = "model.layers.1.mlp.experts.5.gate_proj.weight"
DENSE = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture()
def ckpt(tiny_qwen3, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_qwen3, dst)
    return dst


def edit_config(ckpt, **changes) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(changes)
    (ckpt / "config.json").write_text(json.dumps(cfg))


def generate(capsys, ckpt, *flags: str) -> tuple[int, str]:
    return run_cli(capsys, "generate", "--model", str(ckpt), "--prompt", "x", "--max-tokens", "1", *flags)


# ---------------------------------------------------------------- config.json fields
@pytest.mark.parametrize(
    ("changes", "needles"),
    [
        ({"vocab_size": "abc"}, ["vocab_size", '"abc"', "integer"]),
        ({"num_hidden_layers": 1e6}, ["num_hidden_layers", "1000000.0", "integer in [1, 1024]"]),
        ({"num_hidden_layers": 1_000_000}, ["num_hidden_layers", "1000000", "[1, 1024]"]),
        ({"hidden_size": 0}, ["hidden_size", "got 0"]),
        ({"hidden_size": -64}, ["hidden_size", "got -64"]),
        ({"num_experts_per_tok": -1}, ["num_experts_per_tok", "got -1"]),
        ({"num_local_experts": 0}, ["num_local_experts", "got 0"]),
        ({"moe_intermediate_size": 48.0}, ["moe_intermediate_size", "48.0"]),
        ({"num_attention_heads": True}, ["num_attention_heads", "true"]),
        ({"rms_norm_eps": float("nan")}, ["rms_norm_eps", "NaN", "finite"]),
        ({"rms_norm_eps": -1e-6}, ["rms_norm_eps", "> 0"]),
        ({"tie_word_embeddings": "false"}, ["tie_word_embeddings", "true or false", '"false"']),
        ({"hidden_act": "gelu"}, ["hidden_act", "silu", '"gelu"']),
        ({"rope_parameters": "abc"}, ["rope_parameters", "object"]),
        ({"rope_parameters": {"rope_type": "yarn"}}, ["rope_parameters.rope_type", '"yarn"']),
        ({"rope_parameters": {"rope_theta": "1e4"}}, ["rope_parameters.rope_theta", '"1e4"']),
        ({"architectures": "Qwen3MoeForCausalLM"}, ["architectures", "list of strings"]),
        ({"mlp_only_layers": [99]}, ["mlp_only_layers", "[99]"]),
        ({"decoder_sparse_step": 0}, ["decoder_sparse_step", "got 0"]),
        ({"eos_token_id": "abc"}, ["eos_token_id", '"abc"']),
        ({"num_key_value_heads": 3}, ["num_key_value_heads=3"]),
        ({"num_experts_per_tok": 9}, ["num_experts_per_tok=9", "experts 8"]),
        ({"head_dim": 15}, ["head_dim=15", "even"]),
    ],
)
def test_bad_config_field(capsys, ckpt, changes, needles):
    """Typed and range-checked: one line naming the file, the field and the value."""
    if "num_local_experts" in changes:
        edit_config(ckpt, num_experts=None)  # the tiny checkpoint writes num_experts; read the alias
    edit_config(ckpt, **changes)
    rc, err = generate(capsys, ckpt)
    assert_one_line(rc, err, str(ckpt / "config.json"), *needles)


def test_missing_required_field(capsys, ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["hidden_size"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert_one_line(*generate(capsys, ckpt), "config.json", "'hidden_size'", "missing")


@pytest.mark.parametrize(
    ("content", "needle"), [(b"[" * 100_000, "nested too deeply"), (b'{"vocab_size": "\xff"}', "not UTF-8")]
)
def test_hostile_json(capsys, ckpt, content, needle):
    (ckpt / "config.json").write_bytes(content)
    assert_one_line(*generate(capsys, ckpt), "config.json", needle)


def test_serve_refuses_a_bad_config(capsys, ckpt):
    """``serve`` validates the same way, before the HTTP server starts."""
    edit_config(ckpt, vocab_size="abc")
    rc, err = run_cli(capsys, "serve", "--model", str(ckpt), "--port", "0")
    assert_one_line(rc, err, "config.json", "vocab_size", '"abc"', code=MODEL_EXIT)


# ---------------------------------------------------------------- tensors
def _set(name: str, value) -> callable:
    def edit(tensors):
        t = tensors[name]
        tensors[name] = value(t) if callable(value) else value

    return edit


def _poison(value: float):
    def make(t):
        t = t.clone()
        t.view(-1)[t.numel() // 2] = value
        return t

    return make


@pytest.mark.parametrize("name", [EXPERT, DENSE])
@pytest.mark.parametrize(("value", "word"), [(math.nan, "NaN"), (math.inf, "Inf"), (-math.inf, "Inf")])
def test_non_finite_weight(capsys, ckpt, name, value, word):
    _rewrite(ckpt, _set(name, _poison(value)))
    rc, err = generate(capsys, ckpt)
    assert_one_line(rc, err, "model.safetensors", name, word)


def test_non_finite_weight_refused_by_serve(capsys, ckpt):
    _rewrite(ckpt, _set(EXPERT, _poison(math.nan)))
    assert_one_line(
        *run_cli(capsys, "serve", "--model", str(ckpt), "--port", "0"), EXPERT, "NaN", code=MODEL_EXIT
    )


def test_cast_overflow_is_named(capsys, ckpt):
    """A finite fp32 weight beyond fp16's range would become Inf when cast: refused, naming it."""
    _rewrite(ckpt, _set(EXPERT, _poison(1e6)))
    rc, err = generate(capsys, ckpt, "--dtype", "fp16")
    assert_one_line(rc, err, EXPERT, "1e+06", "overflow float16")
    assert generate(capsys, ckpt, "--dtype", "bf16")[0] == 0  # bf16 holds it


@pytest.mark.parametrize(
    ("name", "dtype"),
    [(EXPERT, torch.int8), (EXPERT, torch.bool), (DENSE, torch.int8), (DENSE, torch.uint8)],
)
def test_non_float_dtype(capsys, ckpt, name, dtype):
    _rewrite(ckpt, _set(name, lambda t: t.to(dtype)))
    rc, err = generate(capsys, ckpt)
    assert_one_line(rc, err, name, f"dtype {str(dtype).removeprefix('torch.')}")


def test_misshaped_dense_tensor(capsys, ckpt):
    _rewrite(ckpt, _set(DENSE, torch.zeros(7, 64)))
    assert_one_line(*generate(capsys, ckpt), DENSE, "[7, 64]")


def test_odd_tensor_names_are_not_weights(capsys, ckpt):
    """Names that only look like weights (a superscript expert index, a trailing newline) are
    not read: even holding NaN they neither crash the loader nor replace the real tensor."""

    def edit(tensors):
        superscript, newline = "model.layers.0.mlp.experts.\u00b2.gate_proj.weight", DENSE + "\n"
        for name in (superscript, newline):
            tensors[name] = torch.full((4,), math.nan)

    _rewrite(ckpt, edit)
    assert generate(capsys, ckpt)[0] == 0


def test_good_checkpoint_still_loads(capsys, ckpt):
    assert generate(capsys, ckpt)[0] == 0


# ---------------------------------------------------------------- files inside the folder
def _shard(ckpt, names_to_file) -> None:
    """Split model.safetensors into the files ``names_to_file(name)`` gives, plus an index."""
    tensors = load_file(str(ckpt / "model.safetensors"))
    (ckpt / "model.safetensors").unlink()
    groups: dict[str, dict] = {}
    for name, t in tensors.items():
        groups.setdefault(names_to_file(name), {})[name] = t
    for file, part in groups.items():
        save_file(part, str(ckpt / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: names_to_file(n) for n in tensors}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))


def test_sharded_checkpoint_loads_the_same(tiny_qwen3, ckpt):
    _shard(ckpt, lambda n: "a.safetensors" if ".experts." in n else "b.safetensors")
    ref, got = load_checkpoint(tiny_qwen3, load_tokenizer=False), load_checkpoint(ckpt, load_tokenizer=False)
    assert torch.equal(ref.store.data, got.store.data)
    assert ref.dense.keys() == got.dense.keys()
    assert all(torch.equal(ref.dense[k], got.dense[k]) for k in ref.dense)


@pytest.mark.parametrize("entry", ["../outside.safetensors", "ABS"])
def test_index_path_escaping_the_folder(capsys, ckpt, entry):
    outside = ckpt.parent / "outside.safetensors"
    entry = str(outside) if entry == "ABS" else entry
    _shard(ckpt, lambda n: "b.safetensors")
    shutil.copy(ckpt / "b.safetensors", outside)  # a readable file: only the path check stops it
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"][EXPERT] = entry
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    rc, err = generate(capsys, ckpt)
    assert_one_line(rc, err, "model.safetensors.index.json", entry, "outside the model folder")


@pytest.mark.parametrize("weight_map", [[], {DENSE: 5}, {DENSE: ""}])
def test_index_weight_map_not_file_names(capsys, ckpt, weight_map):
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert_one_line(*generate(capsys, ckpt), "model.safetensors.index.json", "'weight_map' must be")


def test_symlink_escaping_the_folder(capsys, ckpt):
    outside = ckpt.parent / "elsewhere.safetensors"
    (ckpt / "model.safetensors").rename(outside)
    (ckpt / "model.safetensors").symlink_to(outside)
    rc, err = generate(capsys, ckpt)
    assert_one_line(rc, err, "model.safetensors", str(outside), "outside the model folder")


def test_hugging_face_cache_snapshot_loads(tiny_qwen3, tmp_path):
    """A hub cache snapshot's files are symlinks to ../../blobs: inside the models--* folder."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snap, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in tiny_qwen3.iterdir():
        shutil.copy(f, blobs / f.name)
        (snap / f.name).symlink_to(f"../../blobs/{f.name}")
    loaded = load_checkpoint(snap)
    assert loaded.config.num_experts == 8 and loaded.tokenizer is not None


# ---------------------------------------------------------------- memory plan
def test_plan_equals_what_the_runtime_allocates(tiny_qwen3):
    """The plan is the engine's real allocation: expert store, dense weights, KV cache, slots."""
    for runtime in (
        RuntimeConfig(buffer_slots=5, num_devices=2, max_batch_size=3, max_model_len=40, dtype="bf16"),
        RuntimeConfig(max_batch_size=2),  # every expert resident on one CPU device: slots alias the store
        RuntimeConfig(buffer_fraction=0.5, link_gbps=10.0),
    ):
        loaded = load_checkpoint(tiny_qwen3, runtime, load_tokenizer=False)
        plan = plan_memory(loaded.config, runtime)
        with LLMEngine(loaded, runtime) as engine:
            assert plan.expert_store == loaded.store.nbytes
            assert plan.dense == loaded.dense_nbytes
            assert plan.kv_cache == engine.kv.nbytes
            assert plan.buffer_slots == tuple(p.num_slots for p in engine.buffer.parts)
            aliased = engine.buffer.parts[0].slots.data_ptr() == loaded.store.data.data_ptr()
            assert (plan.slot_bytes == 0) == aliased
            assert plan.host == plan.expert_store + plan.dense + plan.kv_cache + plan.buffer


def test_memory_refused_at_the_boundary(tiny_qwen3, monkeypatch):
    runtime = RuntimeConfig(buffer_slots=4)
    plan = plan_memory(read_model_config(tiny_qwen3)[1], runtime)
    monkeypatch.setattr(memory_plan, "host_available", lambda: (plan.host - 1, "test"))
    with pytest.raises(InsufficientMemoryError, match=r"needs .* of host memory .*available \(test\)"):
        load_checkpoint(tiny_qwen3, runtime, load_tokenizer=False)
    monkeypatch.setattr(memory_plan, "host_available", lambda: (plan.host, "test"))
    assert load_checkpoint(tiny_qwen3, runtime, load_tokenizer=False).store.nbytes == plan.expert_store


def test_experts_larger_than_host_memory(capsys, ckpt):
    """Sizes inside their bounds whose experts need petabytes: refused from the plan, with numbers,
    before any allocation (an attempt would take minutes or be killed)."""
    edit_config(ckpt, num_hidden_layers=1024, num_experts=16384, moe_intermediate_size=1 << 18)
    rc, err = generate(capsys, ckpt)
    assert_one_line(rc, err, str(ckpt), "host memory", "expert store 3.00 PiB", "available (")
    units = {"B": 0, "KiB": 10, "MiB": 20, "GiB": 30, "TiB": 40, "PiB": 50}
    need, avail = (re.search(rf"{word} ([\d.]+) (\w+)", err).groups() for word in ("needs", "only"))
    assert float(need[0]) * (1 << units[need[1]]) > float(avail[0]) * (1 << units[avail[1]])


def test_device_memory_refused(tiny_qwen3, monkeypatch):
    """CUDA: dense + KV cache + slots are compared with torch.cuda.mem_get_info per device."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # one fake GPU: plans only
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    runtime = RuntimeConfig(device="cuda:0", buffer_slots=4)
    plan = plan_memory(read_model_config(tiny_qwen3)[1], runtime)
    need = plan.dense + plan.kv_cache + 4 * plan.slot_bytes
    assert plan.per_device() == {torch.device("cuda", 0): need}
    monkeypatch.setattr(memory_plan, "device_available", lambda dev: need - 1)
    with pytest.raises(InsufficientMemoryError, match=r"cuda:0 needs .*dense .*KV cache .*4 expert slots"):
        check_memory(plan, "m")
    monkeypatch.setattr(memory_plan, "device_available", lambda dev: need)
    check_memory(plan, "m")


def test_cgroup_limit_lowers_available_memory(tmp_path, monkeypatch):
    (tmp_path / "memory.max").write_text(f"{3 << 20}\n")
    (tmp_path / "memory.current").write_text(f"{1 << 20}\n")
    monkeypatch.setattr(memory_plan, "CGROUP_V2", tmp_path)
    assert host_available() == (2 << 20, f"cgroup {tmp_path / 'memory.max'}")
    (tmp_path / "memory.max").write_text("max\n")
    assert host_available()[1] == "MemAvailable"


def test_entry_point_subprocess(ckpt):
    """The installed entry point on a NaN checkpoint: exit 4 (serve's model status), one line."""
    _rewrite(ckpt, _set(EXPERT, _poison(math.nan)))
    out = subprocess.run(
        [sys.executable, "-m", "moeserve", "serve", "--model", str(ckpt), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == MODEL_EXIT, out.stderr
    assert out.stderr.strip().count("\n") == 0 and EXPERT in out.stderr and "Traceback" not in out.stderr
