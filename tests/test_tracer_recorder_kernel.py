"""The recorder's sparse count (``tracer.recorder_counts._add_cells``) equals the two ``np.add.at`` calls
it replaced, repeated cells included, compiled or as plain Python."""

from __future__ import annotations

import numpy as np
import pytest

from tracer.recorder_counts import _add_cells


@pytest.mark.parametrize("seed", range(8))
def test_add_cells_equals_add_at(seed: int) -> None:
    rng = np.random.default_rng(seed)
    B, L, E, k = int(rng.integers(1, 5)), 6, 8, int(rng.integers(1, 4))
    T, n = int(rng.integers(1, 7)) if seed != 5 else 0, int(rng.integers(1, 4))  # seed 5: no tokens
    cells = rng.integers(0, E, size=(n, T, k)) + (rng.integers(0, L, size=n) * E)[:, None, None]
    if seed % 2:
        cells = cells[0]  # one layer: [T, k]
    seq = rng.integers(0, B, size=T)
    prefill = rng.random(T) < 0.5
    tok = seq * (2 * L * E)
    to_table, to_summed = tok + (~prefill) * (L * E), tok // 2
    want_t = np.zeros((B, 2, L, E), dtype=np.int64)
    want_s = np.zeros((B, L, E), dtype=np.float32)
    np.add.at(want_t.reshape(-1), (cells + to_table[:, None]).ravel(), 1)
    np.add.at(want_s.reshape(-1), (cells + to_summed[:, None]).ravel(), np.float32(1))
    assert want_t.sum() == cells.size and (want_t.max() >= 1 or T == 0)
    for fn in (_add_cells, _add_cells.py_func):
        got_t, got_s = np.zeros_like(want_t), np.zeros_like(want_s)
        fn(got_t.reshape(-1), got_s.reshape(-1), cells.ravel(), cells.shape[-1], to_table, to_summed)
        np.testing.assert_array_equal(got_t, want_t)
        np.testing.assert_array_equal(got_s, want_s)
