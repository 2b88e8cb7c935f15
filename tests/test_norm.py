"""RMSNorm: ATen's fused kernel against the composite it replaces."""

from __future__ import annotations

import torch


def test_rms_norm_fused_and_composite_agree(monkeypatch):
    """The fused kernel (where it runs; the CPU prefers the composite) and the five-op composite
    give the same normalisation, in fp32 and cast back to bf16 before the weight; the fused kernel
    takes bf16 in and gives bf16 out, and can write into a view (``out``)."""
    from moe_runtime.layers import norm

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 64, generator=g) * 3, torch.randn(64, generator=g)
    out = {}
    for fused in (True, False):
        monkeypatch.setitem(norm._FUSED, "cpu", fused)
        monkeypatch.setitem(norm.PREFER_FUSED, "cpu", fused)
        out[fused] = (norm.rms_norm(x, w, 1e-6), norm.rms_norm(x.bfloat16(), w.bfloat16(), 1e-6))
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-6, atol=1e-6)
    # in bf16 the fused kernel applies the weight before its one rounding: one bf16 ulp apart
    torch.testing.assert_close(out[True][1], out[False][1], rtol=2**-7, atol=1e-3)
    assert out[True][1].dtype == torch.bfloat16
    monkeypatch.setitem(norm.PREFER_FUSED, "cpu", True)
    plain = norm.normalise(x.bfloat16(), 1e-6)  # without the weight: the composite's bits
    monkeypatch.setitem(norm.PREFER_FUSED, "cpu", False)
    assert torch.equal(plain, norm.normalise(x.bfloat16(), 1e-6))
    buf = torch.zeros(5, 2, 64)
    monkeypatch.setitem(norm.PREFER_FUSED, "cpu", True)
    got = norm.rms_norm(x, w, 1e-6, out=buf[:, 1])
    assert got.data_ptr() == buf[:, 1].data_ptr() and torch.equal(buf[:, 1], out[False][0])
