"""Quantized GEMM benchmark (issue 6 targets) on one CUDA GPU.

    python benchmarks/bench_quant.py                      # correctness, then the GEMM table + targets
    python benchmarks/bench_quant.py --write-choices      # also store the faster FP8/INT8 GEMM per shape
    python benchmarks/bench_quant.py --tune               # also sweep W4A16 (pairs) launch configs, store the best
    python benchmarks/bench_quant.py --tune-ckpt          # the same for the checkpoint-layout W4A16 kernel
    python benchmarks/bench_quant.py --tune-mma           # the same for the mma-layout kernel (CUDA C++), warm L2,
                                                          # printed only (--write-warm stores it)
    python benchmarks/w4_cold_tune.py                     # the mma kernel tuned cold, as the shipped table is
    python benchmarks/bench_quant.py --e2e                # also Llama-3-8B-shape decode at batch 1 per format

Shapes: Llama-3-8B GEMMs, (K, N) in {4096, 14336}^2 and M tokens in {1, 16, 64, 256, 512, 2048}.
Per shape it times ``y = x @ W^T`` for:

* ``bf16``: ``torch.nn.functional.linear`` (cuBLAS), the baseline;
* ``w4a16``: the Triton W4A16 GEMM on the pairs layout (``kernels/w4_pairs.py``: what the
  awq/gptq plugins repack 4-bit weights into; group 128, zero points);
* ``w4a16-mma``: the CUDA C++ W4A16 GEMM (mma.sync) on the mma layout (``kernels/w4_mma.py``,
  ``int4_layout: mma``);
* ``w4a16-ckpt``: the Triton W4A16 GEMM on the AutoAWQ packing itself (``kernels/wna16.py``);
* ``fp8-triton`` / ``fp8-torch``: dynamic per-token FP8 activation quantization (Triton)
  + the Triton FP8 GEMM / ``torch._scaled_mm`` (row-wise scales), per-channel weights;
* ``int8-triton`` / ``int8-torch``: the same with INT8 and the Triton kernel / ``torch._int_mm``.

W8A8 times include the activation quantization (the targets say so). Timing:
``triton.testing.do_bench_cudagraph`` (CUDA graphs hide launch overhead, as in the engine's
decode), median of repeats. Printed: microseconds, TFLOP/s (2*M*N*K / t), speedup over bf16,
weight bytes per format, then PASS/FAIL against the issue's targets:

* W4A16 >= 3x bf16 for M <= 16 and >= 1.5x at M = 64;
* FP8 >= 1.6x bf16 for M >= 512 (faster of Triton / _scaled_mm, activation quant counted);
* end to end (``--e2e``): int4 (AWQ) Llama-3-8B shape decodes >= 2x faster than bf16 at batch 1.

Correctness runs first (each kernel vs the fp32 dequantized reference; it stops on a failure).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (14336, 14336)]  # (K, N)
MS = [1, 16, 64, 256, 512, 2048]
GROUP = 128


# ---------------------------------------------------------------------------------------------
# operands
# ---------------------------------------------------------------------------------------------

def make_operands(k: int, n: int, device="cuda") -> dict:
    """Random operands of every format for one (K, N) weight."""
    from kvforge_plugins.quant.common import pack_rows
    from kvforge_plugins.quant.kernels.w4_mma import pack_mma, pack_mma_groups
    from kvforge_plugins.quant.kernels.w4_pairs import pack_pairs
    from kvforge_plugins.quant.w8a8 import quantize_weight
    g = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(n, k, device=device, generator=g) * 0.02
    ops = {"w_bf16": w.to(torch.bfloat16)}
    q = torch.randint(0, 16, (k, n), device=device, generator=g, dtype=torch.int32)
    cols = torch.arange(n, device=device).view(-1, 8)[:, [0, 2, 4, 6, 1, 3, 5, 7]].reshape(-1)
    ops["awq_qweight"] = pack_rows(q[:, cols].t().contiguous(), 4).t().contiguous()  # [K, N/8]
    ops["awq_scales"] = (torch.rand(k // GROUP, n, device=device, generator=g) * 0.004 + 0.001).half()
    ops["awq_zeros"] = torch.randint(0, 16, (k // GROUP, n), device=device, generator=g).to(torch.uint8)
    # the layout the awq/gptq plugins repack 4-bit weights into at load time (kernels/w4_pairs.py)
    ops["pairs_words"] = pack_pairs(q, GROUP)
    # the mma layout (kernels/w4_mma.py, int4_layout: mma), made for bf16 activations
    ops["mma_words"] = pack_mma(q)
    ops["mma_scales"], ops["mma_zeros"] = pack_mma_groups(ops["awq_scales"].float(), ops["awq_zeros"])
    ops["fp8_w"], ops["fp8_s"] = quantize_weight(w, torch.float8_e4m3fn, True)
    ops["int8_w"], ops["int8_s"] = quantize_weight(w, torch.int8, True)
    return ops


def weight_bytes(k: int, n: int) -> dict[str, int]:
    g = k // GROUP
    return {"bf16": 2 * k * n, "w4a16": k * n // 2 + g * n * 2 + g * n, "fp8": k * n + 4 * n, "int8": k * n + 4 * n}


def methods(ops: dict) -> dict:
    """name -> fn(x) for one weight."""
    from kvforge_plugins.quant.kernels.scaled_mm import quantize_act, scaled_mm_torch, scaled_mm_triton
    from kvforge_plugins.quant.kernels.w4_mma import mma_gemm
    from kvforge_plugins.quant.kernels.w4_pairs import pairs_gemm
    from kvforge_plugins.quant.kernels.wna16 import wna16_gemm
    n = ops["w_bf16"].shape[0]

    def w4(x, config=None):
        return pairs_gemm(x, ops["pairs_words"], ops["awq_scales"], ops["awq_zeros"], group_size=GROUP, tile_k=GROUP,
                          n=n, config=config)

    def w4_mma(x, config=None):
        return mma_gemm(x, ops["mma_words"], ops["mma_scales"], ops["mma_zeros"], group_size=GROUP, n=n, config=config)

    def w4_ckpt(x, config=None):
        return wna16_gemm(x, ops["awq_qweight"], ops["awq_scales"], ops["awq_zeros"], bits=4, group_size=GROUP,
                          pack_k=False, awq_order=True, n=n, config=config)

    def w8a8(qdtype, wkey, impl):
        def fn(x):
            qa, sa = quantize_act(x, qdtype)
            if impl == "torch-fast":  # the fp8 plugin's fast_accum setting (its default)
                return scaled_mm_torch(qa, sa, ops[f"{wkey}_w"], ops[f"{wkey}_s"], x.dtype, use_fast_accum=True)
            f = scaled_mm_torch if impl == "torch" else scaled_mm_triton
            return f(qa, sa, ops[f"{wkey}_w"], ops[f"{wkey}_s"], x.dtype)
        return fn

    return {"bf16": lambda x: F.linear(x, ops["w_bf16"]), "w4a16": w4, "w4a16-mma": w4_mma, "w4a16-ckpt": w4_ckpt,
            "fp8-triton": w8a8(torch.float8_e4m3fn, "fp8", "triton"), "fp8-torch": w8a8(torch.float8_e4m3fn, "fp8", "torch"),
            "int8-triton": w8a8(torch.int8, "int8", "triton"), "int8-torch": w8a8(torch.int8, "int8", "torch"),
            "fp8-torch-fast": w8a8(torch.float8_e4m3fn, "fp8", "torch-fast")}


def references(ops: dict, x: torch.Tensor) -> dict:
    """fp32 dequantized references per format (same quantized operands as the kernels)."""
    from kvforge_plugins.quant.kernels.scaled_mm import quantize_act_ref, scaled_mm_ref
    from kvforge_plugins.quant.kernels.wna16 import dequantize_wna16
    w4 = dequantize_wna16(ops["awq_qweight"], ops["awq_scales"], ops["awq_zeros"], bits=4, group_size=GROUP,
                          pack_k=False, awq_order=True, dtype=torch.float32)
    out = {"bf16": x.float() @ ops["w_bf16"].float().t(), "w4a16": x.float() @ w4}
    for kind, qd in (("fp8", torch.float8_e4m3fn), ("int8", torch.int8)):
        qa, sa = quantize_act_ref(x, qd)
        out[kind] = scaled_mm_ref(qa, sa, ops[f"{kind}_w"], ops[f"{kind}_s"], torch.float32)
    return out


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------

def bench(fn, x, cudagraph: bool, rep: int = 60) -> float:
    """Median time in seconds."""
    import triton.testing as tt
    fn(x)
    torch.cuda.synchronize()
    if cudagraph:
        try:
            return tt.do_bench_cudagraph(lambda: fn(x), rep=rep, return_mode="median") * 1e-3
        except Exception as e:  # some path not capturable: fall back to plain launches
            print(f"  (cuda graph failed: {type(e).__name__}: {str(e)[:80]}; timing without)")
    return tt.do_bench(lambda: fn(x), warmup=10, rep=rep, return_mode="median") * 1e-3


def check_correctness(shapes, ms) -> bool:
    print("== correctness (rel = max|kernel - ref| / max|ref|, bf16 activations) ==")
    ok = True
    bounds = {"bf16": 2e-2, "w4a16": 2e-2, "fp8": 2e-2, "int8": 2e-2}  # bf16 output rounding 2^-8 + order
    for k, n in shapes[:2]:
        ops = make_operands(k, n)
        fns = methods(ops)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            refs = references(ops, x)
            for name, fn in fns.items():
                kind = name.split("-")[0]
                try:
                    y = fn(x)
                except RuntimeError as e:
                    print(f"  {name:12s} M={m:<5d} K={k} N={n}: unsupported here ({str(e)[:60]})")
                    continue
                rel = ((y.float() - refs[kind]).abs().max() / refs[kind].abs().max()).item()
                good = rel <= bounds[kind]
                ok &= good
                print(f"  {name:12s} M={m:<5d} K={k:<6d} N={n:<6d} rel {rel:.2e} (bound {bounds[kind]:.0e}) "
                      f"{'ok' if good else 'FAIL'}")
    return ok


def gemm_table(shapes, ms, cudagraph: bool) -> list[dict]:
    rows = []
    print("\n== GEMM time: us  TFLOP/s  speedup vs bf16 ==")
    for i, (k, n) in enumerate(shapes):
        ops = make_operands(k, n)
        fns = methods(ops)
        if i == 0:
            print(f"{'K':>6} {'N':>6} {'M':>5} | " + " | ".join(f"{nm:>20s}" for nm in fns))
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t = {}
            for name, fn in fns.items():
                try:
                    t[name] = bench(fn, x, cudagraph)
                except RuntimeError:
                    t[name] = float("nan")
            flops = 2 * m * n * k
            cells = [f"{t[nm] * 1e6:7.1f} {flops / t[nm] / 1e12:6.1f} {t['bf16'] / t[nm]:4.2f}x" for nm in fns]
            print(f"{k:6d} {n:6d} {m:5d} | " + " | ".join(f"{c:>20s}" for c in cells), flush=True)
            rows.append({"K": k, "N": n, "M": m, "seconds": t})
        del ops
        torch.cuda.empty_cache()
    return rows


def targets(rows: list[dict]) -> None:
    print("\n== targets (issue 6) ==")
    for r in rows:
        t = r["seconds"]
        tag = f"K={r['K']:<6d} N={r['N']:<6d} M={r['M']:<5d}"
        s4 = t["bf16"] / min(t["w4a16"], t["w4a16-mma"])
        per = f"(pairs {t['bf16'] / t['w4a16']:.2f}x, mma {t['bf16'] / t['w4a16-mma']:.2f}x)"
        if r["M"] <= 16:
            print(f"  W4A16 >= 3.0x   {tag} {s4:5.2f}x  {'PASS' if s4 >= 3.0 else 'FAIL'} {per}")
        if r["M"] == 64:
            print(f"  W4A16 >= 1.5x   {tag} {s4:5.2f}x  {'PASS' if s4 >= 1.5 else 'FAIL'} {per}")
        if r["M"] >= 512:
            # the fp8 plugin's defaults: _scaled_mm with fast_accum (or Triton where the table says)
            fast = t["fp8-torch-fast"]
            best = min(t["fp8-triton"], fast if fast == fast else float("inf"))
            s8 = t["bf16"] / best
            print(f"  FP8   >= 1.6x   {tag} {s8:5.2f}x  {'PASS' if s8 >= 1.6 else 'FAIL'} "
                  f"(triton {t['bf16'] / t['fp8-triton']:.2f}x, _scaled_mm fast_accum (default) "
                  f"{t['bf16'] / fast:.2f}x, _scaled_mm fp32 accumulation {t['bf16'] / t['fp8-torch']:.2f}x)")


def write_choices(rows: list[dict]) -> None:
    from kvforge_plugins.quant.kernels.choices import key, write_table
    gpu = torch.cuda.get_device_name()
    entries: dict = {gpu: {"fp8": {}, "int8": {}}}
    for r in rows:
        t = r["seconds"]
        for kind in ("fp8", "int8"):
            # fp8: the plugin's default torch path is _scaled_mm with fast_accum
            tt_, to = t[f"{kind}-triton"], t["fp8-torch-fast" if kind == "fp8" else f"{kind}-torch"]
            entries[gpu][kind][key(r["M"], r["N"], r["K"])] = "torch" if to == to and to < tt_ else "triton"
    print(f"\nwrote W8A8 choices to {write_table(entries)}")


# ---------------------------------------------------------------------------------------------
# end to end
# ---------------------------------------------------------------------------------------------

E2E_FORMATS = {"bf16": {}, "awq-int4": {"awq": True}, "awq-int4-mma": {"awq": True, "int4_layout": "mma"},
               "awq-int4-mma-unfused-norm": {"awq": True, "int4_layout": "mma", "fuse_norm": False},
               "awq-int4-mma-fuse-norm-8": {"awq": True, "int4_layout": "mma", "fuse_norm_max_tokens": 8},
               "fp8": {"quantization": "fp8"}, "int8": {"quantization": "int8"}}


def e2e_one(fmt: str, input_len: int, output_len: int, batch: int = 1) -> dict:
    """Llama-3-8B shape, dummy weights: the decode step time (TPOT; at ``batch`` sequences
    decoding together) and weight bytes of one format."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from make_dummy_model import make_dummy_model
    from kvforge import LLM, SamplingParams
    opts = E2E_FORMATS[fmt]
    with tempfile.TemporaryDirectory() as tmp:
        d = make_dummy_model(tmp, dtype="float16" if opts.get("awq") else "bfloat16",
                             awq_group=GROUP if opts.get("awq") else None)
        kw = {"quantization": opts["quantization"]} if "quantization" in opts else {}
        if "int4_layout" in opts:
            kw["quantization.settings.int4_layout"] = opts["int4_layout"]
        for name in ("fuse_norm", "fuse_norm_max_tokens"):
            if name in opts:
                kw[f"quantization.settings.{name}"] = opts[name]
        llm = LLM(model=str(d), load_format="dummy", max_model_len=1024, gpu_memory_utilization=0.85, **kw)
        wbytes = llm.llm_engine.parts.weight_bytes  # the engine's figure (since session 32: rotary tables left out)
        prompt = [{"prompt_token_ids": list(range(10 + i, 10 + i + input_len))} for i in range(batch)]

        def run(n_out):
            sp = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True, detokenize=False)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate(prompt, sp, use_tqdm=False)
            torch.cuda.synchronize()
            return time.perf_counter() - t0
        for _ in range(3):
            run(output_len)
        full = sorted(run(output_len) for _ in range(5))[2]
        pre = sorted(run(1) for _ in range(5))[2]
    return {"format": fmt, "batch": batch, "tpot_s": (full - pre) / (output_len - 1), "weight_bytes": wbytes}


def e2e(input_len: int, output_len: int, formats=tuple(E2E_FORMATS), batch: int = 1) -> None:
    print(f"\n== end to end: Llama-3-8B shape, dummy weights, batch {batch} decode ==")
    res = {}
    for fmt in formats:
        proc = subprocess.run([sys.executable, __file__, "--e2e-one", fmt, "--input-len", str(input_len),
                               "--output-len", str(output_len), "--e2e-batch", str(batch)],
                              capture_output=True, text=True)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("E2E ")]
        if proc.returncode or not line:
            print(f"  {fmt}: failed\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}")
            continue
        res[fmt] = json.loads(line[-1][4:])
        r = res[fmt]
        base = res.get("bf16")
        sp = f"{base['tpot_s'] / r['tpot_s']:.2f}x" if base else "-"
        print(f"  {fmt:12s} TPOT {r['tpot_s'] * 1e3:7.2f} ms  ({1 / r['tpot_s']:6.1f} tok/s)  speedup {sp:>6s}  "
              f"weights {r['weight_bytes'] / 2 ** 30:6.2f} GiB", flush=True)
    for fmt in ("awq-int4", "awq-int4-mma"):
        if "bf16" in res and fmt in res and batch == 1:
            s = res["bf16"]["tpot_s"] / res[fmt]["tpot_s"]
            print(f"  target int4 decode >= 2.0x bf16 at batch 1 ({fmt}): {s:.2f}x  {'PASS' if s >= 2.0 else 'FAIL'}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", default=",".join(map(str, MS)), help="token counts M (comma separated)")
    p.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES), help="KxN list")
    p.add_argument("--no-cudagraph", action="store_true", help="time plain launches (launch overhead included)")
    p.add_argument("--write-choices", action="store_true", help="store the faster W8A8 GEMM per shape")
    p.add_argument("--tune", action="store_true", help="sweep W4A16 (pairs layout) configs, store the best per shape")
    p.add_argument("--tune-ckpt", action="store_true", help="the same for the checkpoint-layout W4A16 kernel")
    p.add_argument("--tune-mma", action="store_true",
                   help="the same for the mma-layout W4A16 kernel (CUDA C++), warm L2: printed, not stored")
    p.add_argument("--write-warm", action="store_true",
                   help="store the --tune-mma* winners (replacing the cold-tuned rows of w4_cold_tune.py)")
    p.add_argument("--tune-mma-wide", action="store_true",
                   help="the same over a 120-config grid (quant_tuning.wide_mma_candidates)")
    p.add_argument("--tune-mma-occupancy", action="store_true",
                   help="the same over WG 2 with explicit K splits (quant_tuning.occupancy_mma_candidates)")
    p.add_argument("--tune-mma-cluster", action="store_true",
                   help="the same with split K summed in a thread block cluster (quant_tuning.cluster_mma_candidates)")
    p.add_argument("--e2e", action="store_true", help="end-to-end batch-1 decode per format (Llama-3-8B shape)")
    p.add_argument("--e2e-formats", default=",".join(E2E_FORMATS), help="formats for --e2e (comma separated)")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--json", help="write the GEMM rows here")
    p.add_argument("--e2e-batch", type=int, default=1, help="sequences decoding together in --e2e (the target is batch 1)")
    p.add_argument("--e2e-one", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.e2e_one:
        print("E2E " + json.dumps(e2e_one(a.e2e_one, a.input_len, a.output_len, a.e2e_batch)))
        return 0
    if not torch.cuda.is_available():
        print("bench_quant: needs a CUDA GPU (the CPU paths are the references, tested by tests/test_quant_*.py)")
        return 0
    import triton
    print(f"GPU {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"cc {torch.cuda.get_device_capability()}")
    ms = [int(v) for v in a.m.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    if not check_correctness(shapes, [16, 256]):
        print("correctness FAILED: not timing")
        return 1
    print("\n== weight bytes per (K, N) weight ==")
    for k, n in shapes:
        wb = weight_bytes(k, n)
        print(f"  K={k:<6d} N={n:<6d} " + "  ".join(f"{f} {b / 2 ** 20:7.1f} MiB ({wb['bf16'] / b:.2f}x smaller)"
                                                  for f, b in wb.items()))
    mma_grids = a.tune_mma or a.tune_mma_wide or a.tune_mma_occupancy or a.tune_mma_cluster
    if a.tune or a.tune_ckpt or mma_grids:
        import quant_tuning as qt  # noqa: E402 (benchmarks/ on sys.path)
    if mma_grids:
        grid = (qt.wide_mma_candidates if a.tune_mma_wide else
                qt.occupancy_mma_candidates if a.tune_mma_occupancy else
                qt.cluster_mma_candidates if a.tune_mma_cluster else None)
        qt.tune_wna16(shapes, ms, not a.no_cudagraph, "mma", grid, write=a.write_warm)
    if a.tune:
        qt.tune_wna16(shapes, ms, not a.no_cudagraph, "pairs")
    if a.tune_ckpt:
        qt.tune_wna16(shapes, ms, not a.no_cudagraph, "ckpt")
    rows = gemm_table(shapes, ms, not a.no_cudagraph)
    targets(rows)
    if a.write_choices:
        write_choices(rows)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    if a.e2e:
        e2e(a.input_len, a.output_len, a.e2e_formats.split(","), a.e2e_batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
