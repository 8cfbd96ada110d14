"""W4A16 launch-config tuning for ``bench_quant.py --tune`` / ``--tune-ckpt``: candidate
configs per M and the sweep that stores the fastest per shape in the choices table
(``plugins/quant/kernels/choices.py``). Run through ``bench_quant.py``, not on its own.
"""
from __future__ import annotations

import torch

from bench_quant import GROUP, bench, make_operands, methods


def wna16_candidates(m: int) -> list[dict]:
    """W4A16 configs worth timing at M tokens (keys: ``wna16.DEFAULTS``; merged over the M
    bucket's defaults), ~10-15 per M: each compiles once per shape, and the compiles dominate."""
    def cc(bn, bk, w, **kw):  # CUDA cores (M = 1): [BLOCK_K, BLOCK_N] tiles, a word row per warp and step
        return dict(path="fused", dot=False, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, **kw)

    def swap(bm, bn, bk, w, **kw):  # per-field MMAs, weight as the M side (wgmma A from registers)
        return dict(path="fused", dot=True, swap_ab=True, joined=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                    num_warps=w, **kw)

    def joined(bm, bn, bk, w, **kw):  # one MMA per tile on the re-joined weight tile
        return dict(path="fused", dot=True, joined=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, **kw)

    def dq(bn, bk, w):  # dequantize to a temporary, then cuBLAS
        return dict(path="dequant", BLOCK_N=bn, BLOCK_K=bk, num_warps=w)
    if m == 1:
        return ([cc(bn, bk, w, prefetch=p) for bn, bk, w in ((256, 128, 8), (256, 128, 4), (256, 64, 4),
                                                             (512, 128, 8), (512, 64, 4)) for p in (True, False)]
                + [cc(256, 128, 8, waves=wv, max_split=32) for wv in (1, 4)]
                + [cc(256, 128, 8, reduce="atomic"), swap(16, 512, 64, 4)])
    if m <= 16:
        return ([swap(16, bn, bk, w, num_stages=st) for bn, bk, w in ((512, 64, 4), (512, 128, 4), (1024, 64, 8))
                 for st in (2, 3, 4)]
                + [swap(16, 512, 64, 4, waves=wv) for wv in (1, 4)] + [swap(16, 512, 64, 4, reduce="atomic")]
                + [dict(path="fused", dot=True, swap_ab=False, BLOCK_M=16, BLOCK_N=256, BLOCK_K=128, num_warps=4),
                   joined(16, 256, 64, 4)])
    if m <= 64:
        return ([joined(64, bn, bk, w, max_split=4) for bn, bk, w in ((128, 128, 4), (128, 64, 4), (256, 64, 4),
                                                                      (256, 64, 8))]
                + [joined(64, 128, 128, 4, max_split=ms) for ms in (1, 2, 8)]
                + [joined(64, 128, 128, 4, max_split=8, reduce="atomic")]
                + [swap(bm, 512, 64, 4, max_split=4) for bm in (32, 64)] + [dq(256, 64, 4)])
    return ([dq(bn, bk, w) for bn, bk, w in ((256, 64, 4), (256, 32, 4), (128, 64, 4), (256, 64, 8), (512, 32, 8))]
            + ([joined(bm, 256, 64, 8, max_split=1) for bm in (64, 128)] if m <= 256 else []))


def pairs_candidates(m: int) -> list[dict]:
    """Pairs-layout W4A16 configs worth timing at M tokens (keys: ``w4_pairs.CONFIGS``);
    ``unroll`` ones run the unrolled kernel (tiles per split fixed; larger than the shape's
    tile count means one split)."""
    if m <= 16:
        return ([dict(BLOCK_N=bn, num_warps=w, num_stages=st, waves=wv, max_split=32)
                 for bn, w in ((64, 4), (128, 4), (128, 8), (256, 8)) for st in (2, 3, 4) for wv in (2, 8)]
                + [dict(unroll=t, BLOCK_N=bn, num_warps=w, num_stages=1)
                   for t in (2, 4, 7, 14) for bn, w in ((64, 4), (128, 8), (256, 8))])
    if m < 65:
        return ([dict(BLOCK_N=bn, num_warps=w, num_stages=st, scale_a=sa, waves=wv, max_split=32)
                 for bn, w in ((128, 8), (128, 4), (256, 8)) for st in (3, 4) for sa in (True, False) for wv in (2, 4)]
                + [dict(unroll=t, BLOCK_N=bn, num_warps=8, num_stages=1, scale_a=sa)
                   for t in (2, 4, 7) for bn in (128, 256) for sa in (True, False)])
    return [dict(BLOCK_N=bn, num_warps=w) for bn, w in ((64, 4), (128, 4), (256, 8))]


def mma_candidates(m: int) -> list[dict]:
    """mma-layout W4A16 configs worth timing at M tokens (keys: ``w4_mma.CONFIGS``); each
    distinct set of compile-time constants is one NVRTC compile."""
    if m <= 16:  # (first session-8 sweep: S = 1, MINB = 4 and TW 4 or 1-2 at small N won)
        return [dict(TW=tw, WARPS=wa, S=1, waves=wv, MINB=mb, LDW=ld, CPA=cp) for tw, wa, wv, mb, ld, cp in (
            (4, 4, 4, 4, 0, 0), (4, 4, 4, 4, 1, 0), (4, 4, 2, 4, 1, 0), (4, 4, 4, 1, 1, 0), (2, 8, 2, 1, 0, 0),
            (2, 8, 2, 1, 1, 0), (1, 8, 2, 1, 0, 0), (1, 8, 2, 1, 1, 0), (2, 8, 4, 2, 1, 0),
            # cp.async stages (session 11)
            (4, 4, 4, 1, 1, 3), (4, 4, 4, 1, 1, 4), (4, 4, 2, 1, 1, 4), (4, 4, 4, 1, 1, 6), (2, 8, 2, 1, 1, 4),
            (2, 8, 4, 1, 1, 4), (4, 8, 2, 1, 1, 3), (1, 8, 2, 1, 1, 4), (4, 4, 4, 1, 0, 4))] + [
            # K split by a CTA's warps (session 12: the session's sweep winners and their neighbours)
            dict(TW=tw, WARPS=wa, KW=kw, S=st, CPA=cp, waves=wv, MINB=1, LDW=1, XS=0)
            for tw, wa, kw, st, cp, wv in ((1, 16, 16, 2, 0, 1), (1, 8, 8, 2, 0, 2), (2, 8, 8, 1, 0, 1),
                                           (2, 8, 8, 1, 3, 1), (2, 8, 8, 1, 4, 1), (2, 8, 4, 1, 0, 2),
                                           (4, 4, 4, 1, 0, 2), (4, 8, 4, 1, 0, 2), (4, 4, 4, 1, 3, 1),
                                           (4, 8, 4, 1, 3, 1), (4, 8, 4, 1, 4, 1))] + _xr_candidates(m)
    return [dict(TW=tw, WARPS=wa, S=st, XS=xs, SCALE_A=True, waves=wv, CPA=cp) for tw, wa, st, xs, wv, cp in (
        (1, 4, 1, 0, 2, 0), (1, 4, 2, 0, 2, 0), (1, 8, 1, 1, 2, 0), (1, 8, 2, 0, 2, 0), (2, 4, 1, 0, 2, 0),
        (1, 4, 1, 1, 4, 0), (1, 4, 1, 0, 1, 0), (2, 8, 1, 1, 2, 0),
        (1, 8, 1, 1, 2, 4), (2, 4, 1, 1, 2, 4), (4, 4, 1, 1, 2, 3), (2, 4, 1, 0, 2, 3))] + [
        dict(TW=tw, WARPS=wa, KW=kw, S=1, XS=0, SCALE_A=True, CPA=cp, waves=wv)
        # (cp.async stages beside 8 token blocks of x mostly exceed shared memory: few CPA ones)
        for tw, wa, kw, cp, wv in ((1, 8, 4, 0, 2), (1, 8, 8, 0, 1), (2, 8, 4, 0, 1), (2, 8, 8, 0, 1),
                                   (2, 4, 4, 3, 2))] + _xr_candidates(m)


def _xr_candidates(m: int) -> list[dict]:
    """Configs with x through the CTA's ring (XR, session 14): wide warp tiles sharing one copy
    of x, weights in cp.async stages; (TW, WARPS, KW, CPA, waves). TW 4 at 8 token blocks spills.
    And the same ring read by warpgroup MMAs (WG), and fed by a producer warp (WG 2)."""
    if m <= 16:
        grid = ((4, 4, 1, 4, 2), (4, 4, 4, 3, 1), (4, 8, 4, 4, 1), (2, 8, 8, 3, 1), (4, 4, 2, 4, 1))
    elif m <= 32:
        grid = ((4, 8, 1, 3, 1), (4, 4, 1, 4, 2), (4, 8, 2, 3, 1), (2, 8, 1, 4, 1), (2, 8, 4, 3, 1), (4, 4, 4, 3, 1))
    else:
        grid = ((2, 8, 1, 3, 1), (2, 8, 1, 4, 1), (2, 8, 1, 4, 2), (2, 4, 1, 4, 2), (2, 8, 2, 3, 1),
                (2, 8, 4, 3, 1), (2, 4, 2, 4, 1), (1, 8, 1, 4, 2), (1, 8, 4, 4, 1))
    # WG (warpgroup MMAs, sm_90a; one 64-row block per 4 warps): (WARPS, CPA, waves, MINB)
    wg = ((4, 4, 2, 3), (8, 4, 1, 2), (8, 4, 2, 2), (16, 4, 1, 1), (4, 6, 4, 3)) if m <= 32 else \
        ((4, 4, 2, 3), (8, 4, 1, 1), (8, 4, 1, 2), (8, 4, 2, 2), (16, 4, 1, 1), (16, 6, 1, 1), (8, 6, 2, 2),
         (4, 6, 4, 3))
    # WG 2 (a producer warp's bulk copies, session 15): (WARPS, CPA, waves, MINB)
    ws = ((4, 8, 1, 1), (16, 6, 1, 1), (8, 8, 1, 1)) if m <= 32 else \
        ((4, 8, 1, 1), (4, 8, 1, 2), (4, 6, 2, 2), (8, 8, 1, 1), (16, 8, 1, 1), (16, 6, 1, 1), (4, 4, 1, 3))
    return [dict(TW=tw, WARPS=wa, KW=kw, S=1, XS=0, XR=1, CPA=cp, SCALE_A=True, LDW=1, MINB=1, waves=wv)
            for tw, wa, kw, cp, wv in grid] + [
        dict(TW=1, WARPS=wa, KW=1, S=1, XS=0, XR=1, WG=wg_, CPA=cp, SCALE_A=True, LDW=1, MINB=mb, waves=wv)
        for wg_, grid_ in ((1, wg), (2, ws)) for wa, cp, wv, mb in grid_]


def occupancy_mma_candidates(m: int) -> list[dict]:
    """``--tune-mma-occupancy`` (session 18): WG 2 with K split explicitly, so that 2-4 CTAs
    share each SM. ``waves`` rounds to one split whenever N alone gives more CTAs than SMs
    (14336^2: 224 CTAs, under 2 per SM), so the main grid never filled the 3-4 CTAs per SM
    that WG 2's registers (96) and stages (11 KB each at M = 64) allow. (WARPS, CPA) x split_k."""
    return [dict(TW=1, WARPS=wa, KW=1, S=1, XS=0, XR=1, WG=2, CPA=cp, SCALE_A=True, LDW=1, MINB=1, split_k=sk)
            for wa, cp in ((4, 3), (4, 4), (4, 6), (8, 4)) for sk in (1, 2, 3, 4, 6, 8)]


def cluster_mma_candidates(m: int) -> list[dict]:
    """``--tune-mma-cluster`` (session 19): split K summed inside a thread block cluster (CLU 1,
    2-8 splits) instead of global partials. M > 16: the occupancy grid's WG 2 tiles; M <= 16: the
    mma.sync tilings that won there (K split by the warps, cp.async stages), now with split K."""
    if m > 16:
        return [{**c, "CLU": 1} for c in occupancy_mma_candidates(m) if c["split_k"] > 1]
    return [dict(TW=tw, WARPS=wa, KW=kw, S=1, CPA=cp, LDW=1, MINB=1, SCALE_A=False, XS=0, split_k=sk, CLU=1)
            for tw, wa, kw, cp in ((4, 8, 4, 4), (2, 8, 8, 3), (4, 4, 4, 3), (2, 8, 4, 4), (4, 4, 1, 4))
            for sk in (2, 3, 4)]


def wide_mma_candidates(m: int) -> list[dict]:
    """``--tune-mma-wide``: the twelfth session's sweep grid for the mma kernel, 8 tilings
    (TW, WARPS, KW) x 5 pipelines x 3 split rules (120 configs per shape and M)."""
    tiles = ((1, 8, 8), (1, 16, 16), (2, 8, 4), (2, 8, 8), (4, 4, 4), (4, 8, 4), (2, 4, 2), (1, 8, 4))
    pipes = ((1, 0), (2, 0), (1, 3), (1, 4), (1, 6))  # (S, CPA)
    return [dict(TW=tw, WARPS=wa, KW=kw, S=st, CPA=cp, waves=wv, LDW=1, MINB=1, SCALE_A=False, XS=0)
            for tw, wa, kw in tiles for st, cp in pipes for wv in (1, 2, 4)]


def small_cta_mma_candidates(m: int) -> list[dict]:
    """``w4_cold_tune.py --grid small-ctas`` (session 30): the fastest plain read of a weight's
    bytes ran as thousands of 256-thread CTAs with one load per thread (``w4_floor_cuda.py``),
    not as a few large CTAs with deep pipelines. These tilings keep a CTA to one or two 16-row
    tiles and 2-8 warps that all split K, and split K further across CTAs (2-8 splits summed
    in a cluster, or up to 16 through global memory), with MINB 1 or 4 (fewer registers, more
    CTAs per SM). M <= 16 only. A MINB 4 winner can spill once built with the RMSNorm + RoPE
    prologue, which an untuned shape may run a plain row with: ``tests/test_cuda_sources_compile.py``
    then fails, and the row must not ship (session 30: 4096 x 28672)."""
    if m > 16:
        return []
    return [dict(TW=tw, WARPS=wa, KW=wa, S=st, CPA=0, LDW=1, MINB=mb, SCALE_A=False, XS=0, split_k=sk, CLU=clu)
            for tw, wa in ((1, 2), (1, 4), (1, 8), (2, 4), (2, 8)) for st in (1, 2) for mb in (1, 4)
            for sk, clu in ((1, 0), (2, 1), (4, 1), (8, 1), (4, 0), (8, 0), (16, 0))]


def columns_mma_candidates(m: int) -> list[dict]:
    """``w4_cold_tune.py --grid cols`` (session 33): CTAs of 2 or 4 columns of warps (WARPS / KW) over
    one to four 16-row tiles each, so a CTA's warps share each x run (through L1, or XS 1: shared
    memory). At M = 16 a one-column CTA of 16 rows reads x once per 16 rows of N: four times the
    weights' bytes. CUR 1 register path; K split by the warps and across CTAs (in a cluster or by
    waves). (TW, WARPS, KW) x S x XS x split rule. M <= 16 only."""
    if m > 16:
        return []
    tiles = ((1, 16, 4), (1, 16, 8), (1, 32, 8), (1, 32, 16), (2, 16, 8), (2, 16, 4), (1, 8, 2), (2, 8, 2),
             (1, 4, 1))
    splits = (dict(waves=1), dict(waves=2), dict(waves=4), dict(split_k=2, CLU=1), dict(split_k=4, CLU=1))
    return [dict(TW=tw, WARPS=wa, KW=kw, S=st, CPA=0, CUR=1, LDW=1, MINB=1, SCALE_A=False, XS=xs, **sp)
            for tw, wa, kw in tiles for st in (1, 2) for xs in (0, 1) for sp in splits]


def xs_deep_mma_candidates(m: int) -> list[dict]:
    """``w4_cold_tune.py --grid xs-deep`` (session 32): deep register pipelines (S 2-6) with x
    in shared memory (XS 1). Every other M <= 16 grid keeps XS 0, where each stage holds a
    warp's x run (8 * NB registers per lane, twice the weight's 4 at M = 1), so S 4 took 96
    registers and one 512-thread CTA per SM; with XS 1 the same pipeline takes 64 and all of a
    warp's weight loads at 4096 x 4096 are in flight before its first MMA. The fused-norm
    rows, which need XS 1, won with S 2-4. (TW, WARPS, KW) x S x split rule. M <= 16 only."""
    if m > 16:
        return []
    tiles = ((1, 16, 16), (1, 8, 8), (2, 8, 8), (2, 8, 4), (4, 4, 4), (4, 8, 4), (1, 4, 4), (2, 4, 4), (4, 4, 1),
             (1, 8, 4))
    splits = (dict(waves=1), dict(waves=2), dict(split_k=2, CLU=1), dict(split_k=4, CLU=1))
    return [dict(TW=tw, WARPS=wa, KW=kw, S=st, CPA=0, LDW=1, MINB=1, SCALE_A=False, XS=1, **sp)
            for tw, wa, kw in tiles for st in (2, 3, 4, 6) for sp in splits]


def tune_wna16(shapes, ms, cudagraph: bool, layout: str = "pairs", candidates=None, write: bool = True) -> None:
    """Time the candidates per shape and M (bf16) for the pairs layout (``pairs_candidates``,
    table kind "w4_pairs"), the mma layout (``mma_candidates``, kind "w4_mma") or the AutoAWQ
    packing (``wna16_candidates``, kind "wna16"); ``candidates(m)``, where given, replaces the
    layout's list. With ``write``, store the fastest (merged with the defaults it ran with) in
    the choices table. The timing calls one weight over and over (warm L2)."""
    from kvforge_plugins.quant.kernels import w4_mma, w4_pairs, wna16
    from kvforge_plugins.quant.kernels.choices import key, write_table
    if layout == "pairs":
        kind, name, cands, schema = "w4_pairs", "w4a16", pairs_candidates, w4_pairs.TABLE_SCHEMA
        CONFIGS, DEFAULTS, bucket = w4_pairs.CONFIGS, {}, w4_pairs.bucket
    elif layout == "mma":
        kind, name, cands, schema = "w4_mma", "w4a16-mma", mma_candidates, w4_mma.TABLE_SCHEMA
        CONFIGS, DEFAULTS, bucket = w4_mma.CONFIGS, {}, w4_mma.bucket
    else:
        kind, name, cands, schema = "wna16", "w4a16-ckpt", wna16_candidates, wna16.TABLE_SCHEMA
        CONFIGS, DEFAULTS, bucket = wna16.CONFIGS, wna16.DEFAULTS, wna16.bucket
    cands = candidates or cands
    gpu = torch.cuda.get_device_name()
    best_all: dict = {gpu: {kind: {}}}
    print(f"\n== W4A16 tuning ({layout}) ==")
    for k, n in shapes:
        ops = make_operands(k, n)
        w4 = methods(ops)[name]
        from kvforge_plugins.quant.kernels.wna16 import dequantize_wna16
        w_ref = dequantize_wna16(ops["awq_qweight"], ops["awq_scales"], ops["awq_zeros"], bits=4, group_size=GROUP,
                                 pack_k=False, awq_order=True, dtype=torch.float32)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ w_ref
            base = {**DEFAULTS, **CONFIGS[bucket(m)]}
            default_t = bench(lambda v: w4(v), x, cudagraph)
            best = (default_t, None)
            for cand in cands(m):
                cfg = {**base, **cand}
                try:  # a config that runs but computes garbage must not win
                    rel = ((w4(x, cfg).float() - ref).abs().max() / ref.abs().max()).item()
                    assert rel < 2e-2, f"wrong result: rel {rel:.2e}"
                    tm = bench(lambda v, c=cfg: w4(v, c), x, cudagraph, rep=20)
                except Exception as e:  # e.g. out of shared memory on this GPU
                    print(f"    skipped {cand}: {type(e).__name__}: {str(e)[:100]}")
                    continue
                print(f"    M={m:<5d} {tm * 1e6:7.1f} us {cand}", flush=True)
                if tm < best[0]:
                    best = (tm, cfg)
            print(f"  K={k:<6d} N={n:<6d} M={m:<5d} default {default_t * 1e6:7.1f} us ({bucket(m)}) -> best "
                  f"{best[0] * 1e6:7.1f} us {best[1] and {kk: v for kk, v in best[1].items() if base.get(kk) != v}}",
                  flush=True)
            if best[1] is not None:
                best_all[gpu][kind][key(m, n, k)] = {**best[1], "schema": schema}
        del ops, w_ref
        torch.cuda.empty_cache()
    if write:
        print(f"wrote W4A16 configs to {write_table(best_all)}")
    else:
        print("not written: warm-L2 winners (the shipped w4_mma rows are tuned cold by benchmarks/w4_cold_tune.py; "
              "--write-warm stores these instead)")
