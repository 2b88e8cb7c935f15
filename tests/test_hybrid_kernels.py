"""CPU expert kernels (``moe_runtime.hybrid.cpu_kernels``) and the executor's layer share
(``moe_runtime.hybrid.executor``): the exact kernels give the device path's bits (a plain row's
``F.linear``, a quantized row's dequantizing slot view) whatever memory the weights sit in and
however many rows; the int8 and bf16 kernels are close to the exact ones (bf16 widened exactly);
the kernel choice keeps the exact kernel on a tie and names its GB/s; the executor's outputs land
at the ``(token, rank)`` positions the device paths use."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moe_runtime.hybrid.cpu_kernels import CastLinear, Dequant, Int8Pack, Linear, run_projections
from moe_runtime.hybrid.executor import CPUExpertExecutor
from moe_runtime.hybrid.gemv import Bf16Gemv, Fp8Gemv, Int8Gemv, e4m3_exact, gemv_rows
from moe_runtime.hybrid.kernel_choice import choose_kernels, eligible_kernels, fastest
from moe_runtime.hybrid.layer_share import CPUExperts, expert_rows
from moe_runtime.hybrid.mxfp4_gemv import Mxfp4Gemv, mxfp4_exact, mxfp4_rows
from moe_runtime.layers.experts import _hidden
from moe_runtime.quant.cast import CastCodec
from moe_runtime.quant.fp8 import Fp8BlockCodec
from moe_runtime.quant.int8 import Int8ChannelCodec
from moe_runtime.quant.layout import DequantSlots, ExpertLayout
from moe_runtime.quant.mxfp4 import Mxfp4Codec
from moe_runtime.stats import ExpertStats
from moe_runtime.store import HostExpertStore

H, I, E = 64, 32, 6  # noqa: E741 - hidden, expert width, experts


def make_store(dtype=torch.float32, codec=None, seed: int = 0) -> HostExpertStore:
    layout = ExpertLayout(codec, H, I) if codec is not None else None
    store = HostExpertStore(1, E, H, I, dtype, layout=layout)
    gen = torch.Generator().manual_seed(seed)
    for e in range(E):
        for part, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            store.write(0, e, part, torch.randn(shape, generator=gen).to(dtype) * 0.1, "test")
    return store


def device_path(slot_row: torch.Tensor, x: torch.Tensor, store: HostExpertStore) -> torch.Tensor:
    """What the device path computes for one expert on a slot holding ``slot_row``."""
    if store.layout is None:
        gu = slot_row[: 2 * I * H].view(2 * I, H)
        down = slot_row[2 * I * H :].view(H, I)
    else:
        slots = slot_row.unsqueeze(0)
        gu = DequantSlots(store.layout, slots, "gate_up", store.compute_dtype)[0]
        down = DequantSlots(store.layout, slots, "down", store.compute_dtype)[0]
    return F.linear(_hidden(F.linear(x, gu), None, None), down)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_linear_kernel_equals_the_device_path_bit_for_bit(dtype, rows):
    """The plain row read in place equals ``F.linear`` on a copy of it in another buffer (a slot;
    16-byte aligned as every slot and store row is: BLAS may take another path on misaligned
    rows, and the runtime never makes one)."""
    store = make_store(dtype)
    x = torch.randn(rows, H).to(dtype)
    for e in range(E):
        slot = torch.empty(store.expert_numel + 64, dtype=dtype)[16 : 16 + store.expert_numel]  # other memory
        slot.copy_(store.expert(e))
        got = run_projections(Linear(store), e, x, lambda gu: _hidden(gu, None, None))
        assert torch.equal(got, device_path(slot, x, store))


@pytest.mark.parametrize(
    "codec",
    [Int8ChannelCodec(), Fp8BlockCodec((16, 16)), Mxfp4Codec(), CastCodec(torch.bfloat16, "bf16")],
    ids=["int8", "fp8", "mxfp4", "bf16"],
)
def test_dequant_kernel_equals_the_dequantizing_slots(codec):
    store = make_store(torch.float32, codec)
    x = torch.randn(3, H)
    for e in range(E):
        got = run_projections(Dequant(store), e, x, lambda gu: _hidden(gu, None, None))
        assert torch.equal(got, device_path(store.expert(e).clone(), x, store))


@pytest.mark.parametrize("rows", [1, 2, 5, 9])
def test_int8_kernels_are_close_to_the_dequantized_expert(rows):
    store = make_store(torch.float32, Int8ChannelCodec())
    x = torch.randn(rows, H)
    act = lambda gu: _hidden(gu, None, None)  # noqa: E731
    for e in range(E):
        want = run_projections(Dequant(store), e, x, act)
        gemv = run_projections(Int8Gemv(store), e, x, act)
        torch.testing.assert_close(gemv, want, rtol=1e-4, atol=1e-5)
        pack = run_projections(Int8Pack(store), e, x, act)  # bf16 activations
        torch.testing.assert_close(pack, want, rtol=0.05, atol=0.02)


def _weights(fmt: str, n_out: int, k_in: int, seed: int = 0):
    """``(q, scale, block, float64 weights)`` in ``fmt``: int8 with per-row scales, bf16 bits
    (``int16``) unscaled, or fp8 bits (``uint8``) with 16 x 16 block scales."""
    gen = np.random.default_rng(seed)
    if fmt == "int8":
        q = gen.integers(-127, 128, size=(n_out, k_in)).astype(np.int8)
        s = gen.random((n_out, 1)).astype(np.float32)
        return q, s, (1, 0), q.astype(np.float64) * s
    w = torch.from_numpy(gen.standard_normal((n_out, k_in)).astype(np.float32))
    if fmt == "fp8":
        codec = Fp8BlockCodec((16, 16))
        parts = codec.quantize(w)
        want = codec.dequantize(parts, n_out, k_in, torch.float64).numpy()
        return parts["weight"].view(torch.uint8).numpy(), parts["weight_scale_inv"].numpy(), (16, 16), want
    w = w.to(torch.bfloat16)
    return w.view(torch.int16).numpy(), None, (1, 0), w.double().numpy()


FORMATS = ["int8", "bf16", "fp8"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    ("n_out", "k_in"),
    [(7, 33), (3, 4099), (19, 64), (40, 50)],
    ids=["tail", "tail-only", "streams", "blocks"],
)
def test_gemv_rows_handles_row_and_token_remainders(fmt, n_out, k_in):
    q, s, block, w = _weights(fmt, n_out, k_in)
    x = np.random.default_rng(1).standard_normal((3, k_in)).astype(np.float32)
    out = np.zeros((3, n_out + 3), dtype=np.float32)
    gemv_rows(q, s, *block, 0, x, out, 2)
    want = x.astype(np.float64) @ w.T
    np.testing.assert_allclose(out[:, 2 : 2 + n_out], want, rtol=1e-4, atol=1e-3)
    assert not out[:, :2].any() and not out[:, 2 + n_out :].any()


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_rows_gives_a_row_the_same_bits_in_any_stream_and_range(fmt):
    """A row's sum runs the same loop whichever of the four streams it is in (and an fp8 row block's
    scaled token rows are the same whichever range asks), so any range of rows of at least four
    per row block gives the whole product's bits: the pool can split a gemv expert."""
    q, s, block, _ = _weights(fmt, 70, 300, seed=1)
    x = np.random.default_rng(2).standard_normal((3, 300)).astype(np.float32)  # a pair and one alone
    whole = np.zeros((3, 70), dtype=np.float32)
    gemv_rows(q, s, *block, 0, x, whole, 0)
    ranges = [(0, 16), (16, 48), (48, 70), (5, 9), (3, 70), (60, 67)]
    if fmt == "fp8":  # each range's piece of a 16-row block at least four rows
        ranges = [(0, 16), (16, 48), (48, 70), (4, 12), (20, 40), (32, 70)]
    for a, b in ranges:
        part = np.zeros((3, b - a), dtype=np.float32)
        gemv_rows(q[a:b], s, *block, a, x, part, 0)
        assert np.array_equal(part, whole[:, a:b]), (a, b)


def test_bf16_widening_is_exact():
    """Every bf16 value (each of the 65,536 bit patterns but NaNs) widens to the fp32 torch gives."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    vals = bits.view(torch.bfloat16)
    keep = ~torch.isnan(vals)
    x = np.ones((1, 1), dtype=np.float32)
    q = bits[keep].numpy().reshape(-1, 1)
    out = np.zeros((1, q.shape[0]), dtype=np.float32)
    gemv_rows(q, None, 1, 0, 0, x, out, 0)
    assert np.array_equal(out[0], vals[keep].float().numpy())


def test_fp8_widening_is_exact():
    """Every e4m3fn code but the NaNs, subnormals included, widens to the fp32 torch gives; the
    load-time check (``e4m3_exact``) agrees on this thread."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    vals = codes.view(torch.float8_e4m3fn).float()
    keep = ~torch.isnan(vals)
    q = codes[keep].numpy().reshape(-1, 1)
    out = np.zeros((1, q.shape[0]), dtype=np.float32)
    gemv_rows(q, None, 1, 0, 0, np.ones((1, 1), dtype=np.float32), out, 0)
    assert np.array_equal(out[0], vals[keep].numpy()) and (vals[keep][:8] < 0.02).all()
    assert e4m3_exact()


@pytest.mark.parametrize(
    ("n_out", "k_in"), [(70, 300), (3, 64), (19, 40)], ids=["streams", "tail-only", "pad"]
)
def test_mxfp4_rows_match_the_dequantized_rows_and_split(n_out, k_in):
    """MXFP4 rows (``K`` padded to whole groups) against the codec's dequantized matrix; every
    code at scale 2^0 is exact on this thread; a range of rows gives the whole product's bits."""
    codec = Mxfp4Codec()
    parts = codec.quantize(torch.randn(n_out, k_in) * 0.05)
    want = codec.dequantize(parts, n_out, k_in, torch.float64).numpy()
    blocks, scales = parts["blocks"].numpy(), parts["scales"].numpy()
    x = np.random.default_rng(3).standard_normal((3, k_in)).astype(np.float32)
    out = np.zeros((3, n_out + 1), dtype=np.float32)
    mxfp4_rows(blocks, scales, x, out, 1)
    np.testing.assert_allclose(out[:, 1:], x.astype(np.float64) @ want.T, rtol=1e-5, atol=1e-5)
    assert mxfp4_exact() and not out[:, 0].any()
    for a, b in [(0, 16), (16, 48), (5, 9), (48, 70)]:
        if b <= n_out and b - a >= 4:
            part = np.zeros((3, b - a), dtype=np.float32)
            mxfp4_rows(blocks[a:b], scales[a:b], x, part, 0)
            assert np.array_equal(part, out[:, 1 + a : 1 + b]), (a, b)


def test_mxfp4_gemv_is_close_to_the_dequantizing_kernel():
    store = make_store(torch.float32, Mxfp4Codec())
    x = torch.randn(3, H)
    act = lambda gu: _hidden(gu, None, None)  # noqa: E731
    for e in range(E):
        want = run_projections(Dequant(store), e, x, act)
        torch.testing.assert_close(run_projections(Mxfp4Gemv(store), e, x, act), want, rtol=1e-4, atol=1e-5)


def test_fp8_gemv_is_close_to_the_dequantizing_kernel():
    store = make_store(torch.float32, Fp8BlockCodec((16, 16)))
    x = torch.randn(3, H)
    act = lambda gu: _hidden(gu, None, None)  # noqa: E731
    for e in range(E):
        want = run_projections(Dequant(store), e, x, act)
        torch.testing.assert_close(run_projections(Fp8Gemv(store), e, x, act), want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(Fp8Gemv(store).swiglu(e, x), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("plain", [True, False], ids=["bf16-model", "expert-dtype-bf16"])
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_bf16_gemv_is_close_to_the_exact_kernel(plain, rows):
    """bf16-gemv on a bf16 model's plain rows (bf16 in and out) and on ``--expert-dtype bf16``
    rows under fp32 compute, against the exact kernel: fp32 rounding apart (bf16 output: one
    bf16 rounding). The whole-expert call (its own SiLU; under bf16 the hidden activation rounded
    as the pieces round it) is as close to the pieces."""
    store = (
        make_store(torch.bfloat16) if plain else make_store(torch.float32, CastCodec(torch.bfloat16, "bf16"))
    )
    exact = Linear(store) if plain else Dequant(store)
    x = torch.randn(rows, H).to(store.compute_dtype)
    act = lambda gu: _hidden(gu, None, None)  # noqa: E731
    tol = {"rtol": 0.02, "atol": 0.01} if plain else {"rtol": 1e-4, "atol": 1e-5}
    for e in range(E):
        got = run_projections(Bf16Gemv(store), e, x, act)
        assert got.dtype == store.compute_dtype
        torch.testing.assert_close(got, run_projections(exact, e, x, act), **tol)
        torch.testing.assert_close(Bf16Gemv(store).swiglu(e, x), got, **tol)


def test_eligible_kernels_by_format():
    names = lambda store: [k.name for k in eligible_kernels(store)]  # noqa: E731
    assert names(make_store()) == ["linear"]
    assert names(make_store(torch.bfloat16)) == ["linear", "bf16-gemv"]
    assert names(make_store(torch.float32, Int8ChannelCodec())) == ["dequant", "int8-gemv", "int8pack"]
    assert names(make_store(torch.float32, CastCodec(torch.bfloat16, "bf16"))) == [
        "dequant",
        "cast-linear",
        "bf16-gemv",
    ]
    assert names(make_store(torch.float32, CastCodec(torch.float16, "fp16"))) == ["dequant", "cast-linear"]
    assert names(make_store(torch.float32, Mxfp4Codec())) == ["dequant", "mxfp4-gemv"]
    assert names(make_store(torch.float32, Fp8BlockCodec((16, 16)))) == ["dequant", "fp8-gemv"]
    assert all(k.exact for k in eligible_kernels(make_store())) and not CastLinear.exact


def test_choose_kernels_keeps_the_exact_one_on_a_tie_and_names_its_gbps():
    store = make_store(torch.float32, Int8ChannelCodec())
    kernels = eligible_kernels(store)
    choice = choose_kernels(store, (1, 4), repeats=1, kernels=kernels)
    assert len(choice.kernels) == 2 and set(choice.seconds) == {k.name for k in kernels}
    assert "GB/s at 1 row" in choice.describe() and choice.gbps() > 0
    assert choice.for_rows(1) is choice.kernels[0] and choice.for_rows(100) is choice.kernels[1]

    class Other(Linear):  # not exact: chosen only when faster than the exact one
        name, exact = "other", False

    plain = make_store()
    pair = [Other(plain), Linear(plain)]
    assert fastest(pair, {"other": [1.0], "linear": [1.0]}, 0).name == "linear"  # a tie
    assert fastest(pair, {"other": [0.9, 1.0], "linear": [1.0, 0.9]}, 0).name == "other"
    assert fastest(pair, {"other": [0.9, 1.0], "linear": [1.0, 0.9]}, 1).name == "linear"


def test_expert_rows_positions_follow_ascending_expert_ranks():
    ids = np.array([[3, 1], [1, 5], [5, 3]])
    rows = expert_rows(ids)
    assert sorted(rows) == [1, 3, 5]
    tok, col, pos = rows[1]  # token 0 chose 1 at column 1 (rank 0), token 1 at column 0 (rank 0)
    assert tok.tolist() == [0, 1] and col.tolist() == [1, 0] and pos.tolist() == [0, 2]
    tok, col, pos = rows[3]
    assert tok.tolist() == [0, 2] and col.tolist() == [0, 1] and pos.tolist() == [1, 4]


def test_cpu_share_scales_and_places_like_the_device_path():
    """CPUExperts on a CPU device: each expert's output, scaled by its router weights, equals the
    device path's ``F.linear`` pair on its rows, at its (token, rank) positions."""
    store = make_store()
    ex = CPUExpertExecutor(store, choose_kernels(store, (1,), repeats=1), threads=2)
    try:
        ids = np.array([[0, 2], [2, 4], [4, 0], [1, 2]])
        x = torch.randn(4, H)
        weights = torch.softmax(torch.randn(4, 2), dim=-1)
        share = CPUExperts(ex, 0, [2, 0, 4], E, ExpertStats(1))
        share.start(x, ids, None)
        out = {tuple(p.tolist()): y for p, _, y in share.finish(x, weights)}
        rows = expert_rows(ids)
        for e in (0, 2, 4):
            tok, col, pos = rows[e]
            want = device_path(store.expert(e).clone(), x[torch.from_numpy(tok)], store)
            want = want * weights.reshape(-1)[torch.from_numpy(tok * 2 + col)].unsqueeze(1)
            assert torch.equal(out[tuple(pos.tolist())], want)
        on_cpu, secs = share.mask(E)
        assert on_cpu.tolist() == [True, False, True, False, True, False] and (secs[on_cpu] > 0).all()
        assert len(ex.samples) == 3
    finally:
        ex.close()
