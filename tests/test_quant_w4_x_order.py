"""The K orders in which the warpgroup-MMA int4 kernels take x (``w4_mma_orders``): each
chunk in the mma layout's K order (WG), and as chunk-major 128-byte-swizzled tiles (WG 2),
worked by hand from the definitions; on a GPU, the tiles kernel (``w4_x_tiles``) against its
torch reference, bit for bit. Fresh random data each run."""
from __future__ import annotations

import pytest
import torch

from kvforge_plugins.quant.kernels import w4_mma
from test_quant_w4_mma import cuda, gen  # noqa: F401  (gen: the fresh-seed fixture)


def test_chunk_k_order_worked_by_hand(gen):
    x = torch.randn(3, 128, generator=gen)
    y = w4_mma.chunk_k_order(x)
    # chunk 1, position 16i + 8s + 2t + h with i 3, s 1, t 1, h 1 (= 59) <- column 16t + 4i + 2s + h (= 31);
    # i 1, s 0, t 1, h 0 (position 18) <- column 20; i 0, s 1, t 0, h 1 (position 9) <- column 3
    for pos, col in ((59, 31), (18, 20), (9, 3), (2, 16), (16, 4)):
        assert torch.equal(y[:, 64 + pos], x[:, 64 + col]), (pos, col)
    assert y.is_contiguous() and torch.equal(y.sort(1).values, x.sort(1).values)
    with pytest.raises(ValueError, match="multiple of 64"):
        w4_mma.chunk_k_order(torch.zeros(2, 96))


def test_wg_x_tiles_worked_by_hand(gen):
    x = torch.randn(10, 192, generator=gen)
    y = w4_mma.wg_x_tiles(x)
    assert y.shape == (3, 10, 64) and y.is_contiguous()
    # chunk 2, row 9 (9 % 8 = 1): unit p holds logical unit q = p ^ 1; unit 0 <- q 1 = (i 0, s 1): positions
    # 8 + 2t + h <- columns 16t + 2 + h; unit 5 <- q 4 = (i 2, s 0): columns 16t + 8 + h
    for p, cols in ((0, [2, 3, 18, 19, 34, 35, 50, 51]), (5, [8, 9, 24, 25, 40, 41, 56, 57])):
        assert torch.equal(y[2, 9, 8 * p:8 * p + 8], x[9, 128 + torch.tensor(cols)]), p
    assert torch.equal(y[0, 0], w4_mma.chunk_k_order(x)[0, :64])  # row 0: no swizzle
    with pytest.raises(ValueError, match="multiple of 64"):
        w4_mma.wg_x_tiles(torch.zeros(2, 100))


@cuda
def test_gpu_x_tiles_kernel_matches_reference(gen):
    from kvforge_plugins.quant.kernels.w4_mma_jit import kernels
    for m, k in ((1, 64), (5, 640), (64, 1024), (13, 4096)):
        x = torch.randn(m, k + 64, device="cuda", dtype=torch.bfloat16)[:, :k]  # a row stride past K
        assert torch.equal(kernels().x_tiles(x), w4_mma.wg_x_tiles(x)), (m, k)
