"""Cold-L2 tuning of the int4 mma GEMM's launch configs (issue 6).

``bench_quant.py --tune-mma`` times one weight over and over. In int4, Llama-3-8B's q|k|v, o
and down weights (8-29 MB) fit in the H200's 50 MB L2, so their entries were chosen with the
weight read from L2. In a decode step each layer's weight comes from DRAM, whose latency is
higher, so a config that keeps more loads in flight can win there and lose warm. This tuner times every candidate
*cold*: a CUDA graph of calls that rotate over copies of the weight summing to >= 3x the L2
(``w4_floor.copies`` / ``graph_time``, the regime of BENCHMARKS.md's cold figures).

    python benchmarks/w4_cold_tune.py --shapes 4096x4096,4096x6144 --m 1,16 [--write] [--jobs 12]

Per (shape, M), bf16 activations (the issue's baseline):

1. every candidate once, checked against the fp32 reference (rel < 2e-2) and timed in a short
   graph;
2. the ``--finalists`` fastest and the config ``mma_gemm`` runs now (the table's entry, or its
   nearest neighbour's), timed again side by side in two rounds, longer graphs; the mean of the
   two medians is the figure.

With ``--write`` a finalist replaces the table's entry only when it is at least ``--margin``
(default 2%) faster than the current config in round 2. Candidates: quant_tuning's grids (mma,
wide, cluster and small CTAs; occupancy at M > 16), the register pipeline deepened (S 3 and 4), and every
table entry with the same M key (a config tuned for another shape). Compiles come first, in
``--jobs`` processes: NVRTC builds one module at a time per process, and CuPy (sm_90 modules)
and w4_mma_jit (sm_90a) keep the cubins on disk, where the timing process finds them.

``--prenorm qkv|gate_up`` (M <= 8) times instead the kernel a model runs for q|k|v and gate|up at
batch <= ``fuse_norm_max_tokens`` (2 by default, up to 8): ``mma_gemm_rmsnorm``, the RMSNorm
prologue with the RoPE or SwiGLU epilogue, checked against the current config's output. Its
winners go to the table's ``w4_mma_prenorm`` rows (``w4_mma.PRENORM_KIND``), which only that
kernel reads.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quant_tuning as qt  # noqa: E402
from bench_quant import GROUP  # noqa: E402
from w4_floor import copies, graph_time  # noqa: E402

GRIDS = ("all", "small-ctas", "xs-deep", "cur", "cols", "wst")  # candidates(): every grid, or one of five (and the table's rows)
KEYS_NOT_COMPILED = ("waves", "split_k")  # launch-time only: candidates differing in these share a module


def candidates(m: int, gpu: str, prenorm: bool = False, grid: str = "all") -> list[dict]:
    """Distinct partial configs (merged over the M bucket's defaults when run) worth timing at M
    on the GPU named ``gpu`` (whose table entries join the grids); ``grid`` "small-ctas": only
    ``quant_tuning.small_cta_mma_candidates`` and the table's entries; "xs-deep": only
    ``quant_tuning.xs_deep_mma_candidates`` and the table's entries; "cur": the CUR 1 twins (chunk
    addresses from per-warp bases) of every grid's register-path configs, and the table's entries;
    "cols": only ``quant_tuning.columns_mma_candidates`` and the table's entries; "wst": the WST 1
    twins (WG 2 consumers in trips of CPA chunks) of every grid's and row's WG 2 config with an
    even CPA, at the config's MINB and, for 4 consumer warps (5 with the producer), at MINB 4
    (WST's unrolled trips can take registers that cost a CTA per SM; 4 CTAs of 5 warps fit 96
    registers each), and the table's entries. In "all", each register-path config (CPA 0, no XR)
    is timed with CUR 0 and 1, each such WG 2 config also with WST 1. ``prenorm``: for the
    RMSNorm-prologue kernel, which keeps x in shared memory (XS 1) and so has no XR / WG tiles:
    those are left out, and configs that differ only in XS count once."""
    from kvforge_plugins.quant.kernels import w4_mma
    from kvforge_plugins.quant.kernels.choices import m_bucket, table_entries
    if grid not in GRIDS:
        raise ValueError(f"grid must be one of {GRIDS}, got {grid!r}")
    grids = {"xs-deep": qt.xs_deep_mma_candidates, "cols": qt.columns_mma_candidates}.get(
        grid, qt.small_cta_mma_candidates)(m)
    if grid in ("all", "cur", "wst"):
        grids += qt.mma_candidates(m) + qt.cluster_mma_candidates(m) + qt.xs_deep_mma_candidates(m)
        if m <= 16:
            grids += qt.wide_mma_candidates(m)
            # deeper register pipelines than any grid holds: more weight loads in flight per warp
            grids += [dict(TW=tw, WARPS=wa, KW=kw, S=s, CPA=0, waves=wv, LDW=1, MINB=1, SCALE_A=False, XS=0)
                      for tw, wa, kw in ((1, 16, 16), (1, 8, 8), (2, 8, 8), (2, 8, 4), (4, 4, 4), (4, 8, 4))
                      for s in (3, 4) for wv in (1, 2)]
        else:
            grids += qt.occupancy_mma_candidates(m)
    rows = [{k: v for k, v in e.items() if k != "schema"}
            for kind in (("w4_mma", w4_mma.PRENORM_KIND) if prenorm else ("w4_mma",))
            for row, e in sorted(table_entries(kind, gpu).items())
            if int(row.split("|")[0]) == m_bucket(m) and e.get("schema") == w4_mma.TABLE_SCHEMA]
    if grid in ("all", "cur"):  # the register path's configs (CPA 0, no XR), also with CUR 1
        twins = [{**c, "CUR": 1} for c in grids + rows if not c.get("CPA") and not c.get("XR")]
        grids = twins if grid == "cur" else grids + twins + qt.columns_mma_candidates(m)  # (already CUR 1)
    if grid in ("all", "wst"):  # WG 2 configs also in WST's trips, at their MINB and at 4 CTAs per SM
        wst = [{**c, "WST": 1, **mb} for c in grids + rows if c.get("WG") == 2 and not c.get("WST")
               and c["CPA"] % 2 == 0 for mb in ({}, {"MINB": 4}) if not mb or c["WARPS"] == 4]
        grids = wst if grid == "wst" else grids + wst
    grids += rows
    seen, out = set(), []
    for c in grids:
        full = {**w4_mma.CONFIGS[w4_mma.bucket(m)], **c}
        if prenorm and (full.get("XR") or full.get("WG")):
            continue
        tag = json.dumps({**full, "XS": 1} if prenorm else full, sort_keys=True)
        if tag not in seen:
            seen.add(tag)
            out.append(c)
    return out


def mma_operands(k: int, n: int, seed: int = 0, ref: bool = True) -> dict:
    """Random int4 weights in the mma layout, and (``ref``) their fp32 dequantized [K, N] reference."""
    from kvforge_plugins.quant.kernels.w4_mma import dequantize_mma, pack_mma, pack_mma_groups
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randint(0, 16, (k, n), device="cuda", generator=g, dtype=torch.int32)
    scales = (torch.rand(k // GROUP, n, device="cuda", generator=g) * 0.004 + 0.001).half()
    zeros = torch.randint(0, 16, (k // GROUP, n), device="cuda", generator=g, dtype=torch.int32)
    words = pack_mma(q)
    s, z = pack_mma_groups(scales.float(), zeros)
    out = {"words": words, "scales": s, "zeros": z}
    if ref:
        out["ref"] = dequantize_mma(words, s, z, group_size=GROUP, dtype=torch.float32)
    return out


def _compile_worker(jobs: list) -> int:
    """Run each (k, n, m, cfg, prenorm) once, so its module is compiled into the on-disk caches."""
    ops, done = {}, 0
    for k, n, m, cfg, prenorm in jobs:
        if (k, n) not in ops:
            ops[(k, n)] = mma_operands(k, n, ref=False)
        o = ops[(k, n)]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        try:
            fused = fused_inputs(m, k, n, prenorm) if prenorm else None
            layer_fn(x, n, cfg, fused)(o["words"], o["scales"], o["zeros"])
            done += 1
        except Exception:  # noqa: BLE001 - the timing pass reports the failure
            pass
    torch.cuda.synchronize()
    return done


def precompile(work: list, jobs: int) -> None:
    """Compile every distinct module the (k, n, m, cfg, prenorm) runs need, in ``jobs`` processes."""
    from kvforge_plugins.quant.kernels import w4_mma
    distinct, sms = {}, torch.cuda.get_device_properties(0).multi_processor_count
    for k, n, m, cfg, prenorm in work:
        full = {**w4_mma.CONFIGS[w4_mma.bucket(m)], **(cfg or {})}
        try:
            splits = w4_mma.plan(m, n, k, GROUP, full, sms)[2]
        except Exception:  # noqa: BLE001
            splits = 1
        tag = json.dumps({kk: v for kk, v in full.items() if kk not in KEYS_NOT_COMPILED}, sort_keys=True)
        distinct.setdefault((tag, w4_mma.cluster_splits(full, splits), prenorm), (k, n, m, cfg, prenorm))
    todo = list(distinct.values())
    t0 = time.time()
    with mp.get_context("spawn").Pool(jobs) as pool:
        done = sum(pool.map(_compile_worker, [todo[i::jobs] for i in range(jobs)]))
    print(f"precompiled {done} of {len(todo)} distinct modules in {time.time() - t0:.0f} s ({jobs} processes)",
          flush=True)


def fused_inputs(m: int, k: int, n: int, prenorm: str) -> dict:
    """The extra operands of the model's fused-norm layer kernels (``mma_gemm_rmsnorm``, M <= 8):
    ``qkv`` (RMSNorm prologue, RoPE epilogue: 128-wide heads, the first 5/6 of N rotated, as
    Llama-3-8B's 32 q + 8 k of 48 heads) or ``gate_up`` (RMSNorm prologue, SwiGLU epilogue)."""
    f = {"residual": torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
         "norm": (1 + 0.3 * torch.randn(k, device="cuda")).to(torch.bfloat16), "silu": prenorm == "gate_up"}
    if prenorm == "qkv":
        hd, max_pos = 128, 8192
        ang = torch.rand(max_pos, hd // 2, device="cuda") * 6.3
        f["rope"] = (n // hd * 5 // 6, hd, torch.randint(0, max_pos, (m,), device="cuda"), ang.cos(), ang.sin())
    return f


def layer_fn(x: torch.Tensor, n: int, cfg: "dict | None", fused: "dict | None"):
    """fn(words, scales, zeros) -> y: the plain GEMM, or the fused layer kernel (``fused_inputs``)."""
    from kvforge_plugins.quant.kernels.w4_mma import mma_gemm, mma_gemm_rmsnorm
    if fused is None:
        return lambda w, s, z: mma_gemm(x, w, s, z, group_size=GROUP, n=n, config=cfg)
    return lambda w, s, z: mma_gemm_rmsnorm(x, fused["residual"], fused["norm"], 1e-5, w, s, z, group_size=GROUP,
                                            n=n, config=cfg, silu_and_mul=fused["silu"], rope=fused.get("rope"))[0]


def cold_calls(fn, reps: list) -> list:
    return [lambda r=r: fn(*r) for r in reps]


def tune_one(k: int, n: int, m: int, finalists: int, margin: float, prenorm: "str | None" = None,
             grid: str = "all"):
    """Returns (current time, best time, best full config or None) for one shape and M; with
    ``prenorm``, of the fused layer kernel (``fused_inputs``), checked against the current
    config's output (itself checked by ``w4_table_check.py``)."""
    from kvforge_plugins.quant.kernels import w4_mma
    o = mma_operands(k, n)
    nbytes = sum(o[key].numel() * o[key].element_size() for key in ("words", "scales", "zeros"))
    reps = [(o["words"].clone(), o["scales"].clone(), o["zeros"].clone()) for _ in range(copies(nbytes, True))]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    fused = fused_inputs(m, k, n, prenorm) if prenorm else None
    ref = (layer_fn(x, n, None, fused)(o["words"], o["scales"], o["zeros"]) if fused else x.float() @ o["ref"]).float()
    base = w4_mma.CONFIGS[w4_mma.bucket(m)]
    first = []
    for cand in candidates(m, torch.cuda.get_device_name(), bool(prenorm), grid):
        cfg = {**base, **cand}
        try:
            y = layer_fn(x, n, cfg, fused)(o["words"], o["scales"], o["zeros"])
            rel = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            if not rel < 2e-2:
                raise AssertionError(f"wrong result: rel {rel:.2e}")
            t = graph_time(cold_calls(layer_fn(x, n, cfg, fused), reps), reps=3, replays=3)
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory, too many registers
            print(f"    skipped {cand}: {type(e).__name__}: {str(e)[:90]}", flush=True)
            continue
        first.append((t, cand))
    first.sort(key=lambda tc: tc[0])
    for t, cand in first[:finalists]:
        print(f"    round 1 {t * 1e6:7.2f} us {cand}", flush=True)
    arms = [("current", None)] + [(f"#{i}", {**base, **c}) for i, (_, c) in enumerate(first[:finalists])]
    times = {name: [] for name, _ in arms}
    for _ in range(2):
        for name, cfg in arms:
            times[name].append(graph_time(cold_calls(layer_fn(x, n, cfg, fused), reps), reps=20, replays=7))
    best, won = pick(times, margin)
    mean = means(times)
    cur = mean["current"]
    print(f"  K={k:<6d} N={n:<6d} M={m:<3d}{' ' + prenorm if prenorm else ''} cold: current {cur * 1e6:7.2f} us "
          f"({', '.join(f'{v * 1e6:.2f}' for v in times['current'])})"
          + (f" | best {best} {mean[best] * 1e6:7.2f} us, {cur / mean[best]:.3f}x "
             f"{'-> table' if won else '(kept current)'}: {dict(arms)[best]}" if best else ""), flush=True)
    del reps
    torch.cuda.empty_cache()
    return cur, (mean[best] if best else cur), (dict(arms)[best] if won else None)


def means(times: dict) -> dict:
    """{arm: mean of its round-2 times} for ``times`` {arm: [seconds, ...]}."""
    return {name: sum(v) / len(v) for name, v in times.items()}


def pick(times: dict, margin: float) -> "tuple[str | None, bool]":
    """(the fastest finalist by mean time, whether it replaces the table's entry): ``times``
    maps "current" and each finalist to its round-2 times in seconds; a finalist wins only
    when its mean is at least ``margin`` (a fraction) below the current config's, so noise
    between equal configs does not churn the table."""
    mean = means(times)
    rivals = [name for name in times if name != "current"]
    if not rivals:
        return None, False
    best = min(rivals, key=mean.get)
    return best, mean[best] <= mean["current"] * (1 - margin)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="4096x4096,4096x6144,14336x4096,4096x14336,4096x28672", help="KxN list")
    p.add_argument("--m", default="1,16")
    p.add_argument("--finalists", type=int, default=5)
    p.add_argument("--margin", type=float, default=0.02)
    p.add_argument("--jobs", type=int, default=12, help="compile processes (0: compile while timing)")
    p.add_argument("--write", action="store_true", help="store winners in the choices table")
    p.add_argument("--prenorm", choices=("qkv", "gate_up"),
                   help="time the model's fused layer kernel (M <= 8: RMSNorm prologue; RoPE or SwiGLU epilogue); "
                        "winners go to the table's w4_mma_prenorm rows")
    p.add_argument("--grid", choices=GRIDS, default="all",
                   help="candidates: every grid, or only small CTAs with K split across them, or only deep register "
                        "pipelines with x in shared memory, or only CUR 1 register-path configs, or only CTAs of several "
                        "columns of warps, or only WST 1 twins of the WG 2 configs (and the table's rows)")
    a = p.parse_args(argv)
    from kvforge_plugins.quant.kernels import w4_mma
    from kvforge_plugins.quant.kernels.choices import key, write_table
    import triton
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    ms = [int(v) for v in a.m.split(",")]
    top = w4_mma.MAX_NORM_M if a.prenorm else w4_mma.MAX_FUSED_M
    if not all(1 <= m <= top for m in ms):
        p.error(f"--m: each M must be 1..{top} (the fused kernel{' with the RMSNorm prologue' if a.prenorm else ''})")
    kind = w4_mma.PRENORM_KIND if a.prenorm else "w4_mma"
    if not torch.cuda.is_available():
        print("w4_cold_tune: needs a CUDA GPU (sm_90 for the shipped table's warpgroup configs)")
        return 1
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}  torch {torch.__version__}  triton {triton.__version__}  cold L2, bf16", flush=True)
    if a.jobs:  # (a failure here only costs time: the timing pass compiles what is missing)
        try:
            precompile([(k, n, m, {**w4_mma.CONFIGS[w4_mma.bucket(m)], **c}, a.prenorm) for k, n in shapes for m in ms
                        for c in candidates(m, gpu, bool(a.prenorm), a.grid)], a.jobs)
        except Exception as e:  # noqa: BLE001
            print(f"precompile failed ({type(e).__name__}: {e}); compiling while timing", flush=True)
    for k, n in shapes:
        for m in ms:
            _, _, cfg = tune_one(k, n, m, a.finalists, a.margin, a.prenorm, a.grid)
            if cfg is not None and a.write:
                row = {key(m, n, k): {**cfg, "schema": w4_mma.TABLE_SCHEMA}}
                print(f"wrote {kind} {key(m, n, k)} to {write_table({gpu: {kind: row}})}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
