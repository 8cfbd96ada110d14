"""The CPU emulation of WG 2 (tests/w4_mma_emulate_ws.py) can fail: each fault planted in the
kernel source (a wrong copy, offset, byte count, init count, parity or release) makes the
emulated GEMM raise or miss the reference, while the unmodified source passes. Fresh random
data each run."""
from __future__ import annotations

import pytest
import torch

from kvforge_plugins.quant.kernels import w4_mma, w4_mma_jit
from kvforge_plugins.quant.kernels.w4_mma import pack_mma, pack_mma_groups
from test_quant_w4_mma import BOUND, _quant, gen  # noqa: F401  (gen: the fresh-seed fixture)

# (what the kernel says, the fault): each must be caught
FAULTS = [
    ("wq + ((size_t)(blk0 + b) * KC + c) * 128", "wq + ((size_t)(blk0) * KC + c) * 128"),  # every block's weights from the first
    ("bulk_copy(st + WS_W + b * 2048,", "bulk_copy(st + WS_W + b * 1024,"),  # weights of two blocks overlap
    ("nb * (gs ? 2048 + WS_REC : 2048)", "nb * (gs ? 2048 + 128 : 2048)"),  # expected bytes short of the copies
    ("mbar_init(bars + 8 * (CPA + s), 4 * nb);", "mbar_init(bars + 8 * (CPA + s), nb);"),  # stage freed early
    ("mbar_init(bars + 8 * s, 1);", "mbar_init(bars + 8 * s, 2);"),  # full barrier never completes
    ("lds128(st + WS_W + wb * 2048 + (tile * 32 + lane) * 16)", "lds128(st + WS_W + (tile * 32 + lane) * 16)"),
    ('"r"(sz + 128 + 8 * g + 4 * (tile >> 1))', '"r"(sz + 8 * g + 4 * (tile >> 1))'),  # zeros read from the scales
    ("cur.z[0] = z >> (8 * (tile & 1));", "cur.z[0] = z;"),  # odd tiles take their even neighbour's zeros
    ('"r"(sz + 128 + 8 * g + 4 * (tile >> 1))', '"r"(sz + 128 + 8 * g)'),  # tiles 2, 3 take 0, 1's zeros
    ("j > 0 ? (j - 1) % CPA : -1, fc, fp);", "j > 0 ? j % CPA : -1, fc, fp);"),  # released while in flight
    ("mbar_wait(EMPTY(s), (j / CPA - 1) & 1);", "mbar_wait(EMPTY(s), (j / CPA) & 1);"),  # waits a phase ahead
    ("run(j % CPA, (j / CPA) & 1,", "run(j % CPA, (j / CPA + 1) & 1,"),  # reads before the copies
    ("compute_chunk_wg(A, cur, gs, st, fc, fp);", "compute_chunk_wg(A, cur, gs, st + WS_W, fc, fp);"),  # x slot
]
CASE = (640, 320, 64, 21, dict(NB=4, TW=1, WARPS=8, CPA=3, XR=1, WG=2, SCALE_A=True, split_k=2))
# WST's trips of CPA chunks: 10 chunks of groups of 2 in one split, so two trips of 4, then a
# generic pair; the second CTA has one live block
WST_FAULTS = [
    ("run(u, r & 1,", "run(u, (r + 1) & 1,"),  # a trip reads before the copies
    ("u ? u - 1 : (r ? CPA - 1 : -1)", "u ? u - 1 : -1"),  # a trip's first chunk never frees the last stage
    ("run(u + 1, r & 1, (u + 1) % GCC == 0, u,", "run(u + 1, r & 1, (u + 1) % GCC == 0, u + 1,"),  # freed in flight
    ("run(u + 1, r & 1, (u + 1) % GCC == 0,", "run(u + 1, r & 1, u % GCC == 0,"),  # scale group opened late
    ("run(u + 1, r & 1,", "run(u, r & 1,"),  # a chunk read from its neighbour's stage
]
WST_CASE = (640, 320, 128, 21, dict(NB=4, TW=1, WARPS=8, CPA=4, XR=1, WG=2, SCALE_A=True, WST=1, split_k=1))


def _emulated_error(monkeypatch, gen, source: str, case=CASE) -> float:
    import w4_mma_emulate
    monkeypatch.setattr(w4_mma_jit, "SOURCE", source)
    w4_mma_emulate.install(monkeypatch)
    k, n, group, m, cfg = case
    q, s, z, w_ref = _quant(k, n, group, gen)
    ps, pz = pack_mma_groups(s, z)
    x = torch.randn(m, k, generator=gen).bfloat16()
    y = w4_mma.mma_gemm(x, pack_mma(q), ps, pz, group_size=group, n=n, config=cfg)
    ref = x.double() @ w_ref.double()
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


def test_unmodified_source_passes(monkeypatch, gen):
    assert _emulated_error(monkeypatch, gen, w4_mma_jit.SOURCE) <= BOUND[torch.bfloat16]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # a faulty copy can put NaN bits where x should be
@pytest.mark.parametrize("fault", range(len(FAULTS)))
def test_planted_fault_is_caught(fault, monkeypatch, gen):
    good, bad = FAULTS[fault]
    assert w4_mma_jit.SOURCE.count(good) == 1, good
    try:
        err = _emulated_error(monkeypatch, gen, w4_mma_jit.SOURCE.replace(good, bad))
    except AssertionError:
        return  # the emulation's checks caught it
    assert not err <= BOUND[torch.bfloat16], f"planted fault not caught: {bad} (error {err})"


def test_unmodified_source_passes_with_wst(monkeypatch, gen):
    assert _emulated_error(monkeypatch, gen, w4_mma_jit.SOURCE, WST_CASE) <= BOUND[torch.bfloat16]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("fault", range(len(WST_FAULTS)))
def test_planted_wst_fault_is_caught(fault, monkeypatch, gen):
    good, bad = WST_FAULTS[fault]
    assert w4_mma_jit.SOURCE.count(good) == 1, good
    try:
        err = _emulated_error(monkeypatch, gen, w4_mma_jit.SOURCE.replace(good, bad), WST_CASE)
    except AssertionError:
        return
    assert not err <= BOUND[torch.bfloat16], f"planted fault not caught: {bad} (error {err})"
