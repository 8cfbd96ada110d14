"""``benchmarks/w4_floor_cuda.py``'s bulk-copy read (the TMA floor of issue 6's W4A16 targets):
on the GPU each CTA's checksum of the chunks it waited for matches the buffer, so no stage was
reused before its bytes arrived and no chunk was skipped; on the CPU, the reference checksum
on a hand-worked example."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import w4_floor_cuda  # noqa: E402

from test_quant_w4_mma import cuda  # noqa: E402


def test_bulk_checksums_hand_example():
    buf = torch.arange(16, dtype=torch.int32)  # 64 bytes: word i at byte 4i
    # 2 CTAs of 32 bytes, 16-byte chunks: words 0, 4 and 8, 12
    assert w4_floor_cuda.bulk_checksums(buf, cb=16, grid=2).tolist() == [0 ^ 4, 8 ^ 12]
    # 3 CTAs: ceil(64 / 3) = 22 -> 32 bytes each, so the third range is empty
    assert w4_floor_cuda.bulk_checksums(buf, cb=16, grid=3).tolist() == [0 ^ 4, 8 ^ 12, 0]
    # one CTA, 48-byte chunks: the second chunk is partial (16 bytes)
    assert w4_floor_cuda.bulk_checksums(buf, cb=48, grid=1).tolist() == [0 ^ 12]


def test_bulk_read_refuses_bad_sizes_before_launching():
    # (no CuPy needed: the checks come first; Kernels() itself would import CuPy)
    with pytest.raises(ValueError, match="not a multiple of 16"):
        w4_floor_cuda.Kernels.bulk_read(None, torch.zeros(5, dtype=torch.int32), torch.zeros(4, dtype=torch.int32),
                                        4096, 2, 1)
    with pytest.raises(ValueError, match="fewer than the grid's 8 CTAs"):
        w4_floor_cuda.Kernels.bulk_read(None, torch.zeros(8, dtype=torch.int32), torch.zeros(4, dtype=torch.int32),
                                        4096, 2, 8)


@cuda
@pytest.mark.parametrize("cb,stages,grid", [(4096, 2, 7), (16384, 8, 132), (8192, 4, 528)])
def test_gpu_bulk_read_checksums(cb, stages, grid):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cp.async.bulk needs sm_90")
    pytest.importorskip("cupy")
    nwords = (3 << 20) // 4 + 12  # 3 MiB + 48 bytes: ranges and last chunks end mid-chunk
    buf = torch.randint(-2 ** 31, 2 ** 31 - 1, (nwords,), dtype=torch.int32, device="cuda")
    out = torch.zeros(grid, dtype=torch.int32, device="cuda")
    w4_floor_cuda.Kernels().bulk_read(buf, out, cb, stages, grid)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), w4_floor_cuda.bulk_checksums(buf.cpu(), cb, grid))
