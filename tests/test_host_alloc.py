"""The engine keeps freed host memory (``moe_runtime.host_alloc``): after it starts, a large
temporary allocated and freed again and again on the main thread reuses the heap instead of
faulting in fresh pages each time (glibc's defaults map and unmap it, or trim it back)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap

import pytest

import moe_runtime.host_alloc as host_alloc

CHILD = textwrap.dedent(
    """
    import resource, sys, torch
    from moeserve.bench.cpu_experts import make_store
    from moe_runtime.hybrid.cpu_kernels import Dequant, _silu_glu, run_projections
    import moe_runtime.hybrid.gemv  # numba and LLVM loaded, as in every runtime process
    if sys.argv[1] == "engine":
        from moe_runtime.assets import default_model_dir
        from moe_runtime.config import RuntimeConfig
        from moe_runtime.engine.engine import LLMEngine
        LLMEngine.from_pretrained(default_model_dir(), RuntimeConfig(max_model_len=64)).close()
    torch.set_num_threads(1)
    store = make_store(2048, 768, "int8", 16, 0)  # Qwen3-30B-A3B's expert shape, int8
    k, x = Dequant(store), torch.randn(1, 2048)
    with torch.inference_mode():
        run_projections(k, 0, x, _silu_glu)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for e in range(8):  # each call dequantizes the expert to fp32 (18 MiB of temporaries)
            run_projections(k, e % store.num_experts, x, _silu_glu)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def _faults(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if k not in host_alloc._ENV}
    if mode == "plain":  # glibc's starting threshold, held: its dynamic one moves with what was
        # freed before (what the imports' threads happened to free), 3,000-73,000 faults run to run
        env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, env=env, check=True
    )
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator only")
def test_the_engine_keeps_freed_memory_for_the_next_temporary():
    """An int8 expert dequantized per call on the main thread: about 12,300 page faults a call
    with glibc's starting mmap threshold held (128 KiB) on a 2-core EPYC host, none once an
    engine has started."""
    if not host_alloc.keep_freed_memory():
        pytest.skip("not glibc, or the thresholds are set in the environment")
    plain, engine = _faults("plain"), _faults("engine")
    pages = 8 * (18 << 20) // resource.getpagesize()
    assert plain > pages // 4, plain  # the default: temporaries fault their pages in again
    assert engine < plain // 5, (engine, plain)


def test_the_users_settings_win(monkeypatch):
    monkeypatch.setattr(host_alloc, "_done", None)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000")
    assert host_alloc.keep_freed_memory() is False
    monkeypatch.setattr(host_alloc, "_done", None)
