"""The mma int4 kernel's index arithmetic replayed on the CPU (tests/w4_mma_emulate.py): the
host side (``w4_mma.mma_gemm``: plan, workspace, XS fallback) runs for real, the launch is
emulated with every load bounds- and alignment-checked, against the fp64 reference. Fresh
random data each run; bounds as tests/test_quant_w4_mma.py."""
from __future__ import annotations

import pytest
import torch

from kvforge_plugins.quant.kernels import w4_mma
from kvforge_plugins.quant.kernels.w4_mma import pack_mma, pack_mma_groups
from test_quant_w4_mma import BOUND, _quant, gen  # noqa: F401  (gen: the fresh-seed fixture)


# The kernels' index arithmetic replayed on the CPU (tests/w4_mma_emulate.py): every load
# bounds- and alignment-checked, each stage holding the chunk being computed, split-K partials
# summed in a random arrival order. (K, N, group, M, config): odd N / 64, uneven last splits,
# TW 1/2 with tile0 != 0, XS, S up to 4, SCALE_A, per-channel groups, the dequantize path, and
# cp.async stages (CPA 2-8: more stages than a split has chunks, with and without XS), K
# split by a CTA's warps (KW, with idle warps, beside split K), the XR x ring, WG's wgmma and
# WG 2's producer warp.
EMULATED = [
    (512, 192, 64, 3, None),
    (512, 320, 128, 17, None),
    (768, 320, 256, 9, dict(TW=2, WARPS=2, S=3, XS=1)),
    (768, 448, 256, 33, dict(TW=1, WARPS=3, S=2, XS=1, SCALE_A=False)),
    (1024, 192, 1024, 1, dict(TW=4, S=2)),
    (640, 192, 128, 5, dict(TW=2, WARPS=1, S=3, split_k=3)),
    (640, 320, 64, 24, dict(TW=1, WARPS=4, S=4, split_k=3, XS=1)),
    (576, 64, 576, 2, dict(TW=1, WARPS=1, S=2)),
    (1152, 128, 384, 8, dict(TW=2, WARPS=4, S=2, XS=1, SCALE_A=True, split_k=2)),
    (512, 192, 64, 64, None),
    (512, 192, 64, 65, None),
    (640, 192, 128, 5, dict(TW=4, WARPS=2, CPA=3, split_k=3)),
    (768, 320, 256, 17, dict(TW=2, WARPS=4, CPA=4, XS=1, SCALE_A=True)),
    (1152, 448, 384, 9, dict(TW=1, WARPS=3, CPA=2, SCALE_A=False, split_k=2)),
    (576, 128, 576, 1, dict(TW=2, WARPS=1, CPA=8)),
    # KW: warps of a CTA split K (idle warps where a split has fewer groups than KW)
    (640, 192, 128, 5, dict(TW=2, WARPS=4, KW=2, S=2, split_k=2)),
    (768, 320, 64, 3, dict(TW=1, WARPS=8, KW=4, CPA=3, XS=1)),
    (1152, 448, 384, 17, dict(TW=4, WARPS=4, KW=4, S=1, SCALE_A=False)),
    (512, 128, 128, 1, dict(TW=2, WARPS=8, KW=8, CPA=4, split_k=1)),
    # XR: x through the CTA's ring (M not a multiple of 8, dead warps in the barrier loop, KW
    # shares with uneven chunk counts, more stages than a split has chunks, split K beside)
    (768, 320, 256, 64, dict(NB=8, TW=2, WARPS=2, CPA=3, XR=1, SCALE_A=True)),
    (640, 192, 128, 37, dict(NB=8, TW=2, WARPS=4, CPA=2, XR=1, SCALE_A=True, split_k=3)),
    (1152, 448, 384, 17, dict(NB=4, TW=1, WARPS=4, KW=2, CPA=4, XR=1, SCALE_A=False)),
    (512, 128, 64, 9, dict(NB=2, TW=4, WARPS=2, CPA=8, XR=1, split_k=2)),
    (512, 192, 64, 1, dict(NB=1, TW=2, WARPS=4, KW=4, CPA=3, XR=1)),
    # WG: warpgroup MMAs reading x from the ring by descriptor (a dead warpgroup, split K)
    (768, 320, 256, 64, dict(NB=8, TW=1, WARPS=4, CPA=3, XR=1, WG=1, SCALE_A=True)),
    (640, 192, 128, 13, dict(NB=2, TW=1, WARPS=8, CPA=3, XR=1, WG=1, SCALE_A=True, split_k=3)),
    (512, 128, 64, 5, dict(NB=1, TW=1, WARPS=4, CPA=8, XR=1, WG=1, SCALE_A=True, split_k=2)),
    # WG 2: a producer warp's bulk copies through mbarrier-guarded stages (dead warpgroups,
    # an odd chunk count, more stages than chunks, split K)
    (768, 320, 256, 64, dict(NB=8, TW=1, WARPS=16, CPA=4, XR=1, WG=2, SCALE_A=True)),
    (640, 192, 128, 13, dict(NB=2, TW=1, WARPS=8, CPA=3, XR=1, WG=2, SCALE_A=True, split_k=3)),
    (576, 128, 64, 7, dict(NB=1, TW=1, WARPS=4, CPA=8, XR=1, WG=2, SCALE_A=True, split_k=1)),
    # CLU: split K summed in a thread block cluster (no workspace); 1 group, 1 split: global path
    (768, 320, 128, 40, dict(NB=8, TW=1, WARPS=4, CPA=4, XR=1, WG=2, SCALE_A=True, split_k=3, CLU=1)),
    # WST: WG 2's consumers in trips of CPA chunks (trips only; trips and a pair; an odd count)
    (768, 320, 128, 40, dict(NB=8, TW=1, WARPS=4, CPA=4, XR=1, WG=2, SCALE_A=True, split_k=3, CLU=1, WST=1)),
    (640, 192, 128, 13, dict(NB=2, TW=1, WARPS=8, CPA=4, XR=1, WG=2, SCALE_A=True, split_k=1, WST=1)),
    (576, 128, 64, 7, dict(NB=1, TW=1, WARPS=4, CPA=8, XR=1, WG=2, SCALE_A=True, split_k=1, WST=1)),
    (640, 192, 64, 9, dict(TW=4, WARPS=4, KW=2, SCALE_A=True, split_k=5, CLU=1)),
    (512, 128, 512, 3, dict(TW=2, WARPS=4, split_k=2, CLU=1)),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(EMULATED)))
def test_emulated_kernel_indexing(case, dtype, gen, monkeypatch):
    import w4_mma_emulate
    k, n, group, m, cfg = EMULATED[case]
    fake = w4_mma_emulate.install(monkeypatch)
    q, s, z, w_ref = _quant(k, n, group, gen)
    ps, pz = pack_mma_groups(s, z)
    x = torch.randn(m, k, generator=gen).to(dtype)
    y = w4_mma.mma_gemm(x, pack_mma(q), ps, pz, group_size=group, n=n, config=cfg)
    ref = x.double() @ w_ref.double()
    err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
    assert err <= BOUND[dtype], f"seed {gen.initial_seed()} case {case}: {err}"
    assert bool(fake.calls) == (m <= w4_mma.MAX_FUSED_M)  # the fused kernel ran, or the dequantize path


def test_wg_config_runs_on_mma_sync_without_sm90a(gen, monkeypatch):
    """A WG config on a GPU without sm_90a (wgmma) runs the same tiles on mma.sync: the launch
    gets WG 0 and keeps the XR ring, and the result is right."""
    import w4_mma_emulate
    fake = w4_mma_emulate.install(monkeypatch)
    monkeypatch.setattr(w4_mma, "wgmma_capable", lambda device: False)
    q, s, z, w_ref = _quant(512, 128, 64, gen)
    ps, pz = pack_mma_groups(s, z)
    x = torch.randn(16, 512, generator=gen).bfloat16()
    y = w4_mma.mma_gemm(x, pack_mma(q), ps, pz, group_size=64, n=128,
                        config=dict(TW=1, WARPS=4, CPA=3, XR=1, WG=1, SCALE_A=True))
    cfg = fake.calls[-1]["cfg"]
    assert cfg["WG"] == 0 and cfg["XR"] == 1
    ref = x.double() @ w_ref.double()
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() <= BOUND[torch.bfloat16]


def test_cp_async_zero_point_shift_follows_the_source(gen, monkeypatch):
    """The emulation takes the zero-point shift of the cp.async path (read_stage's last
    argument) from the kernel source, so a wrong shift there fails: with none, the odd tiles of
    a TW 1 config would subtract their even neighbour's zero points."""
    import w4_mma_emulate
    from kvforge_plugins.quant.kernels import w4_mma_jit
    good = "gstart, 8 * (tile0 & 1));"
    assert w4_mma_jit.SOURCE.count(good) == 2
    q, s, z, w_ref = _quant(512, 128, 64, gen)
    ps, pz = pack_mma_groups(s, z)
    x = torch.randn(3, 512, generator=gen).half()
    ref = x.double() @ w_ref.double()
    cfg = dict(TW=1, WARPS=4, CPA=3, split_k=1)  # tiles 0-3 of a block, one per warp
    for source, ok in ((w4_mma_jit.SOURCE, True), (w4_mma_jit.SOURCE.replace(good, "gstart, 0);"), False)):
        monkeypatch.setattr(w4_mma_jit, "SOURCE", source)
        w4_mma_emulate.install(monkeypatch)
        y = w4_mma.mma_gemm(x, pack_mma(q), ps, pz, group_size=64, n=128, config=cfg)
        err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
        assert (err <= BOUND[torch.float16]) == ok, (ok, err)


def test_host_stage_size_is_the_sources():
    """The host sizes WG 2's shared memory from ``ws_stage_bytes``; the kernel lays its stages
    out by ``WS_STAGE`` (parsed from the source): they must agree for every launchable tile."""
    from w4_mma_emulate_ws import ws_layout
    lay = ws_layout()
    for nb in (1, 2, 4, 8):
        for warps in range(4, 29, 4):
            assert w4_mma.ws_stage_bytes(dict(NB=nb, WARPS=warps)) == lay["stage"](nb, warps), (nb, warps)
