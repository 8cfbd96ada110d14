"""Probe, not a shipped kernel: does W4A16 at M <= 64 go faster with wgmma's roles swapped?
``w4_ss_probe.cu`` makes x wgmma's A and the dequantized weights B, both from shared memory
(m64n(64 PBN)k16 SS), where the shipped WG / WG 2 keep the weights in registers (RS, N = 8 NB).
Times it (kernel alone, and with the host's split-K sum) beside bf16 and the shipped table, checks
each result against the fp32 reference of the dequantized weight (rel < 2e-2), then leaves parts
out (LO_LD, LO_DQ, LO_MMA: wrong results by design). Session 16; results in BENCHMARKS.md.

    python benchmarks/w4_ss_probe.py
    python benchmarks/w4_ss_probe.py --sweep   # CTAs per SM: splits x stages x PBN at M = 64

``--sweep`` asks whether more independent consumer warpgroups per SM pay: session 16's runs used
2 splits, i.e. 224 CTAs at PBN 2, fewer than two per SM whatever the stage count allowed.
"""
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_quant import GROUP, bench, make_operands, methods  # noqa: E402
from kvforge_plugins.quant.kernels import w4_mma_jit  # noqa: E402
from kvforge_plugins.quant.kernels.wna16 import dequantize_wna16  # noqa: E402
from wgmma_probe import wgmma_source  # noqa: E402

PROBE = (Path(__file__).with_name("w4_ss_probe.cu")).read_text()
# the helpers it uses are compiled in with a WG 2 config of the shipped kernel
HOST_CFG = dict(NB=8, TW=1, WARPS=4, S=1, CPA=4, XR=1, SCALE_A=1, WG=2)


_FNS: dict = {}


def probe_fn(pbn: int, pcpa: int, pch: int, leave_out: str = ""):
    """(kernel, dynamic shared memory bytes) for PBN blocks, PCPA stages of PCH chunks."""
    key = (pbn, pcpa, pch, leave_out)
    if key not in _FNS:
        import cupy
        from cupy_backends.cuda.libs import nvrtc
        src = w4_mma_jit.SOURCE + "\n" + PROBE.replace("@WGMMA_SS@", wgmma_source(64 * pbn))
        opts = (*w4_mma_jit.nvrtc_options(torch.bfloat16, HOST_CFG), f"-DPBN={pbn}", f"-DPCPA={pcpa}", f"-DPCH={pch}",
                *((f"-D{leave_out}=1",) if leave_out else ()), "-arch=sm_90a")
        prog = nvrtc.createProgram(src, "w4_ss_probe.cu", (), ())
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(nvrtc.getProgramLog(prog)) from e
        path = Path(f"/tmp/w4_ss_probe_{pbn}_{pcpa}_{pch}_{leave_out}.cubin")
        path.write_bytes(nvrtc.getCUBIN(prog))
        nvrtc.destroyProgram(prog)
        fn = cupy.RawModule(path=str(path)).get_function("w4_ss_probe")
        stage = -(-(pch * 8192 + pbn * pch * (2048 + 192)) // 1024) * 1024
        smem = pcpa * stage + 2 * pbn * 8192 + 1024
        fn.max_dynamic_shared_size_bytes = smem
        _FNS[key] = (fn, smem)
    return _FNS[key]


def split_plan(k: int, splits: int, pch: int) -> tuple[int, int]:
    """(chunks per split, splits used): whole groups and stages per split."""
    kc, unit = k // 64, max(GROUP // 64, pch)  # (both powers of two)
    assert kc % unit == 0, "the probe needs whole stages"
    cps = -(-(-(-kc // splits)) // unit) * unit
    return cps, -(-kc // cps)


def probe(x, ops, k, n, pbn, pcpa, pch, splits, ws_buf, leave_out=""):
    """fp32 partials [splits', M, N] of x @ W (splits' <= splits: whole groups and stages per split)."""
    import cupy
    fn, smem = probe_fn(pbn, pcpa, pch, leave_out)
    m = x.shape[0]
    xt = w4_mma_jit.kernels().x_tiles(x)
    kc, gc = k // 64, GROUP // 64
    cps, sp = split_plan(k, splits, pch)
    ws = ws_buf[: sp * m * n].view(sp, m, n)
    p = lambda t: np.uint64(t.data_ptr())  # noqa: E731
    with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        fn((n // (64 * pbn), sp), (160,), (p(xt), np.int32(m), p(ops["mma_words"]), p(ops["mma_scales"]),
                                          p(ops["mma_zeros"]), np.int32(kc), np.int32(n // 64), np.int32(gc),
                                          np.int32(cps), p(ws), np.int32(n)), shared_mem=smem)
    return ws


def ctas_per_sm(pbn: int, pcpa: int, pch: int) -> int:
    """Resident CTAs of 160 threads per SM on an H100/H200 (sm_90: 228 KB of shared memory with
    1 KB reserved per CTA, 64K registers allocated per warp in units of 256, 2048 threads)."""
    fn, smem = probe_fn(pbn, pcpa, pch)
    by_smem = (228 * 1024) // (smem + fn.shared_size_bytes + 1024)
    by_regs = 65536 // (5 * (-(-fn.num_regs * 32 // 256) * 256))
    return min(by_smem, by_regs, 2048 // 160, 32)


def run(k, n, ms, cfgs, leave_out=""):
    """Print each config's times; return {(m, cfg): kernel + sum seconds} of the correct ones."""
    found = {}
    ops = make_operands(k, n)
    meth = methods(ops)
    w_ref = dequantize_wna16(ops["awq_qweight"], ops["awq_scales"], ops["awq_zeros"], bits=4, group_size=GROUP,
                             pack_k=False, awq_order=True, dtype=torch.float32)
    ws_buf = torch.empty(8 * 64 * n, device="cuda", dtype=torch.float32)
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ w_ref
        tb = bench(lambda v: meth["bf16"](v), x, True)
        tt = bench(lambda v: meth["w4a16-mma"](v), x, True)
        print(f"K={k} N={n} M={m}: bf16 {tb * 1e6:.1f} us, shipped table {tt * 1e6:.1f} us ({tb / tt:.2f}x)", flush=True)
        for pbn, pcpa, splits, pch in cfgs:
            name = f"PBN {pbn} PCPA {pcpa} splits {splits} PCH {pch}"
            if not leave_out:
                try:
                    ctas = (n // (64 * pbn)) * split_plan(k, splits, pch)[1]
                    name += f" [{ctas} CTAs, {ctas_per_sm(pbn, pcpa, pch)}/SM resident]"
                except Exception as e:  # (compile errors are reported below)
                    name += f" [occupancy unknown: {type(e).__name__}]"
            try:
                out = probe(x, ops, k, n, pbn, pcpa, pch, splits, ws_buf, leave_out).sum(0)
                rel = ((out - ref).abs().max() / ref.abs().max()).item()
                t1 = bench(lambda v: probe(v, ops, k, n, pbn, pcpa, pch, splits, ws_buf, leave_out), x, True, rep=30)
                t2 = bench(lambda v: probe(v, ops, k, n, pbn, pcpa, pch, splits, ws_buf, leave_out).sum(0).to(torch.bfloat16),
                           x, True, rep=30)
                verdict = "(left out)" if leave_out else ("ok" if rel < 2e-2 else "WRONG")
                if verdict == "ok":
                    found[(m, (pbn, pcpa, splits, pch))] = t2
                print(f"  {name}: kernel {t1 * 1e6:6.1f} us ({tb / t1:.2f}x), + sum {t2 * 1e6:6.1f} us ({tb / t2:.2f}x)"
                      f"  rel {rel:.1e} {verdict}", flush=True)
            except Exception as e:  # e.g. more shared memory than the device has
                print(f"  {name}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
    return found


def main() -> int:
    print("GPU", torch.cuda.get_device_name(), "torch", torch.__version__)
    if "--sweep" in sys.argv:
        cfgs = [(pbn, pcpa, splits, 1) for pbn in (4, 2, 1) for pcpa in (4, 3, 2) for splits in (2, 4, 6, 8)]
        found = run(14336, 14336, [64], cfgs)
        best = sorted(found, key=found.get)[:4]
        print("== the four fastest at 14336^2 (kernel + sum) on the other Llama-3-8B shapes, M = 64 and 16")
        for k, n in ((4096, 28672), (14336, 4096), (4096, 6144), (4096, 4096)):
            run(k, n, [64, 16], [cfg for _, cfg in best])
        return 0
    run(14336, 14336, [64, 16], [(2, 4, 2, 1), (4, 4, 2, 1), (2, 4, 2, 2), (2, 3, 2, 4), (4, 2, 2, 4)])
    run(4096, 28672, [64], [(2, 4, 1, 1), (4, 4, 1, 2)])
    for leave_out in ("LO_LD", "LO_DQ", "LO_MMA"):
        print("== leave out", leave_out)
        run(14336, 14336, [64], [(2, 4, 2, 1), (4, 4, 2, 1)], leave_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
