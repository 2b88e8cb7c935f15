"""Expert weight formats (moe_runtime/quant): exact round trips on representable values, MXFP4
equal to transformers' dequantization bit for bit, FP8 block dequantization equal to the
per-block formula, and the packed expert row."""

from __future__ import annotations

import math

import pytest
import torch

from moe_runtime.quant.cast import CastCodec
from moe_runtime.quant.fp8 import E4M3, Fp8BlockCodec, block_for
from moe_runtime.quant.int8 import Int8ChannelCodec
from moe_runtime.quant.layout import DequantSlots, ExpertLayout
from moe_runtime.quant.mxfp4 import FP4_VALUES, Mxfp4Codec

GEN = torch.Generator().manual_seed(0)


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN)


def test_fp8_block_dequant_is_the_per_block_formula():
    codec = Fp8BlockCodec((32, 16))
    w = _randn(48, 40) * 3
    parts = codec.quantize(w)
    q, s = parts["weight"], parts["weight_scale_inv"]
    assert q.dtype == E4M3 and s.dtype == torch.float32 and s.shape == (2, 3)  # ceil(48/32), ceil(40/16)
    got = codec.dequantize(parts, 48, 40, torch.float32)
    for i in range(2):  # ragged last blocks: rows 32..47, columns 32..39
        for j in range(3):
            rows, cols = slice(32 * i, 32 * (i + 1)), slice(16 * j, 16 * (j + 1))
            assert torch.equal(got[rows, cols], q[rows, cols].to(torch.float32) * s[i, j])
            # the block's largest magnitude maps to e4m3's largest value, 448; rounding error
            # within e4m3's half step (2^-4 relative) plus its smallest subnormal step
            assert q[rows, cols].float().abs().max() == 448.0
            err = (got[rows, cols] - w[rows, cols]).abs()
            assert (err <= w[rows, cols].abs() * 2**-4 + s[i, j] * 2**-9).all()


def test_fp8_round_trip_exact_on_representable_values():
    codec = Fp8BlockCodec((4, 8))
    # e4m3 values times a power-of-two block scale whose block maximum is 448: stored exactly
    vals = torch.tensor([448.0, -448.0, 1.0, -0.5, 0.0, 3.5, 240.0, -0.015625])
    w = vals.repeat(4, 2)[:, torch.randperm(16, generator=GEN)] * 2.0**-6
    w[0, 0], w[0, 8] = 448 * 2.0**-6, 448 * 2.0**-6
    assert torch.equal(codec.dequantize(codec.quantize(w), 4, 16, torch.float32), w)


def test_fp8_default_blocks():
    assert block_for(7168, 2048) == (128, 128)
    assert block_for(128, 64) == (64, 64)
    assert block_for(64, 48) == (32, 32)


def test_int8_round_trip_and_per_channel_scale():
    codec = Int8ChannelCodec()
    scale = torch.tensor([[0.5], [2.0**-7], [3.0]])
    q = torch.randint(-127, 128, (3, 20), generator=GEN, dtype=torch.int64)
    q[:, 0] = 127  # each row's maximum is 127 * its scale
    w = q.float() * scale
    parts = codec.quantize(w)
    assert parts["weight"].dtype == torch.int8 and torch.equal(parts["weight"].long(), q)
    assert torch.equal(parts["weight_scale"], scale)
    assert torch.equal(codec.dequantize(parts, 3, 20, torch.float32), w)


def test_mxfp4_round_trip_exact_on_representable_values():
    codec = Mxfp4Codec()
    codes = torch.randint(0, 16, (6, 64), generator=GEN)
    codes[:, 0], codes[:, 32] = 7, 15  # every group holds +-6: the scale is exactly its exponent
    exps = torch.randint(-8, 5, (6, 2), generator=GEN).float()
    w = torch.tensor(FP4_VALUES)[codes] * torch.exp2(exps).repeat_interleave(32, dim=1)
    parts = codec.quantize(w)
    assert parts["blocks"].shape == (6, 2, 16) and parts["scales"].shape == (6, 2)
    assert torch.equal(parts["scales"].float(), exps + 127)
    assert torch.equal(codec.dequantize(parts, 6, 64, torch.float32), w)
    # an MXFP4-dequantized matrix quantizes back to the same values (a checkpoint's experts can be
    # dequantized at load and kept as mxfp4 without loss)
    again = codec.quantize(codec.dequantize(parts, 6, 64, torch.float32))
    assert torch.equal(codec.dequantize(again, 6, 64, torch.float32), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dequant_equals_transformers(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    codec = Mxfp4Codec()
    experts, out, inn = 3, 10, 96
    w = _randn(experts, out, inn) * torch.exp2(torch.randint(-6, 6, (experts, out, 1), generator=GEN).float())
    parts = [codec.quantize(w[e]) for e in range(experts)]
    blocks = torch.stack([p["blocks"] for p in parts])  # [E, out, G, 16], gpt-oss's *_blocks
    scales = torch.stack([p["scales"] for p in parts])  # [E, out, G], gpt-oss's *_scales
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]
    ours = codec.dequantize({"blocks": blocks, "scales": scales}, out, inn, dtype)  # [E, out, in]
    assert ours.dtype == dtype and torch.equal(ours, theirs.transpose(1, 2))
    rel = ((ours.float() - w).norm() / w.norm()).item()
    assert rel < 0.15, rel  # 3-bit mantissa... e2m1 and one exponent per 32: ~10% relative error


def test_mxfp4_pads_widths_that_are_not_multiples_of_32():
    codec = Mxfp4Codec()
    w = torch.tensor([[6.0, -3.0, 0.5] * 16])  # [1, 48]: groups of 32 and 16 (+16 zeros)
    parts = codec.quantize(w)
    assert parts["blocks"].shape == (1, 2, 16)
    assert torch.equal(codec.dequantize(parts, 1, 48, torch.float32), w)


@pytest.mark.parametrize(
    "codec",
    [Fp8BlockCodec((32, 32)), Int8ChannelCodec(), Mxfp4Codec(), CastCodec(torch.bfloat16, "bf16")],
    ids=lambda c: c.name,
)
def test_packed_row_holds_each_matrix(codec):
    hidden, inter = 64, 48
    lay = ExpertLayout(codec, hidden, inter)
    assert lay.nbytes % 16 == 0
    mats = {"gate": _randn(inter, hidden), "up": _randn(inter, hidden), "down": _randn(hidden, inter)}
    rows = torch.zeros(3, lay.nbytes, dtype=torch.uint8)
    for s in range(3):
        for part, m in mats.items():
            for name, value in codec.quantize(m * (s + 1)).items():
                lay.write(rows[s], part, name, value)
    want = {p: codec.dequantize(codec.quantize(m * 2), *m.shape, torch.float32) for p, m in mats.items()}
    assert torch.equal(lay.dequant(rows[1], "down", torch.float32), want["down"])
    gu = DequantSlots(lay, rows, "gate_up", torch.float32)
    assert torch.equal(gu[1], torch.cat([want["gate"], want["up"]]))
    gu_t = DequantSlots(lay, rows, "gate_up", torch.float32, transposed=True)
    assert gu_t[0:3].shape == (3, hidden, 2 * inter)
    assert torch.equal(gu_t[0:3][1], gu[1].T)
    # bytes per expert: the quantized data plus scales, against 3 * I * H fp32 values
    plain = 3 * inter * hidden * 4
    data = {"fp8": 1, "int8": 1, "mxfp4": 0.5, "bf16": 2}[codec.name]
    assert plain / 4 * data <= lay.nbytes <= math.ceil(plain / 4 * data * 1.2)
