"""Rotary position embedding (RoPE) with a cos/sin table built once: the default type, partial
rotary (only the leading ``rotary_dim`` dims of a head turn, GLM-4.5), YaRN (gpt-oss) and LongRoPE
(Phi-3.5-MoE).

LongRoPE as transformers 5's ``PhimoeRotaryEmbedding`` computes it: inverse frequencies divided by
the ``short_factor`` list, cos/sin multiplied by ``short_mscale`` while a forward call's largest
position + 1 is at most ``original_max_position_embeddings``, else by ``long_mscale``. Within the
original context (all that the tests check) our table equals transformers' bit for bit. Beyond it
the table applies that rule per position: a token at position ``>= original`` gets
``long_mscale``, an earlier one ``short_mscale``, which equals transformers for every decode step
of one sequence but not for a prefill chunk that crosses the boundary (transformers scales the
whole call by ``long_mscale``; a per-call rule cannot be batched). transformers 5's Phimoe forward
never uses ``long_factor`` (it recomputes the inverse frequencies without a sequence length), and
neither do we; the original Phi-3 code switches to it beyond the original context.
"""

from __future__ import annotations

import torch

from moe_runtime.config_types import LongRoPE, YarnScaling
from moe_runtime.layers.yarn import yarn_inv_freq


class Rotary:
    """Precomputed cos/sin table (:attr:`table`) for positions ``0..max_len-1``.

    Values match the reference: inverse frequencies and angles in fp32, then cast to ``dtype``.
    ``rotary_dim`` (default ``head_dim``): the leading dims of each head that turn, the rest pass
    through (transformers' ``apply_rotary_pos_emb`` with a partial ``cos``).
    With ``yarn`` (gpt-oss) the inverse frequencies and the cos/sin factor are YaRN's
    (:func:`moe_runtime.layers.yarn.yarn_inv_freq`, transformers' ``_compute_yarn_parameters``).
    """

    def __init__(
        self,
        head_dim: int,
        theta: float,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        rotary_dim: int | None = None,
        longrope: LongRoPE | None = None,
        yarn: YarnScaling | None = None,
    ) -> None:
        dim = rotary_dim or head_dim
        self.dim = dim
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        factor = 1.0
        if yarn is not None:
            inv_freq, factor = yarn_inv_freq(dim, theta, yarn)
        elif longrope is None:
            inv_freq = 1.0 / (theta**exponent)
        else:
            inv_freq = 1.0 / (torch.tensor(longrope.short_factor, dtype=torch.float32) * theta**exponent)
        pos = torch.arange(max_len, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]  # [max_len, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if longrope is not None:  # transformers' per-call rule, applied per position (module doc)
            beyond = pos[:, None] + 1 > longrope.original_max_position_embeddings
            scale = torch.where(beyond, longrope.long_mscale, longrope.short_mscale)
            cos, sin = cos * scale, sin * scale
        if yarn is not None:
            cos, sin = cos * factor, sin * factor
        # One table ``[max_len, 2, 1, head_dim]`` for :meth:`rows`: cos, then sin with its first half
        # negated (``rotate_half(x) * sin == turn(x) * signed`` exactly: ``-(a * b) == a * -b``),
        # padded to the whole head with cos 1 and sin 0 where a partial rotary leaves dims as they
        # are (``x * 1 + y * 0 == x``).
        half = dim // 2
        signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        if dim < head_dim:
            pad = head_dim - dim
            cos = torch.cat((cos, cos.new_ones(max_len, pad)), dim=-1)
            signed = torch.cat((signed, signed.new_zeros(max_len, pad)), dim=-1)
        self.head_dim = head_dim
        self.table = torch.stack((cos, signed), dim=1)[:, :, None].to(dtype=dtype, device=device)
        # the partial rotary's turn as an index over the head dim: its rotated dims' halves swapped
        perm = torch.cat((torch.arange(half, dim), torch.arange(half), torch.arange(dim, head_dim)))
        self._perm = None if dim == head_dim else perm.to(device)

    @property
    def cos(self) -> torch.Tensor:
        """``[max_len, rotary_dim]`` cos table (from :attr:`table`)."""
        return self.table[:, 0, 0, : self.dim]

    @property
    def sin(self) -> torch.Tensor:
        """``[max_len, rotary_dim]`` sin table (from :attr:`table`, its first half's sign restored)."""
        signed = self.table[:, 1, 0, : self.dim]
        return torch.cat((-signed[:, : self.dim // 2], signed[:, self.dim // 2 :]), dim=-1)

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, signed_sin)`` of ``positions [T]``, ``[T, 1, head_dim]`` each: gathered once per
        step and shared by every layer (``StepContext.cached``); two ops."""
        return self.table.index_select(0, positions).unbind(1)

    def turn(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., head_dim]`` with each rotated pair's halves swapped (one op)."""
        if self._perm is None:
            return x.roll(self.dim // 2, -1)
        return x.index_select(-1, self._perm)

    def rotate_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, heads, head_dim]`` (queries and keys in one tensor, or a view into the
        fused projection's output) in place by the rows of :meth:`rows` (``[T, 1, head_dim]``):
        ``x * cos + rotate_half(x) * sin``, the reference's arithmetic bit for bit, in four ops
        (an ``addcmul_`` would make it three, but may fuse its multiply and add: not the
        reference's rounding)."""
        turned = self.turn(x).mul_(sin)
        if torch.compiler.is_compiling():  # the compiler takes no strided ``out=``: the same write
            return x.copy_(x * cos + turned)
        return torch.add(x * cos, turned, out=x)

    def apply(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` by the angles of ``positions [T]`` (new
        tensors; the model rotates its fused projection in place with :meth:`rotate_`)."""
        cos, sin = self.rows(positions)
        return tuple(self.rotate_(z.clone(), cos, sin) for z in (q, k))  # type: ignore[return-value]
