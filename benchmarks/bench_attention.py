"""Benchmark the ``triton_paged`` attention backend on CUDA (a script, not a test).

    python benchmarks/bench_attention.py [--dtype bfloat16] [--block-size 16] [--block-m 64] [--block-n 0]
    python benchmarks/bench_attention.py --sweep-prefill   # prefill tile / warps / stages grid
    python benchmarks/bench_attention.py --block-m 128 --prefill-block-n 128 --prefill-warps 8 --prefill-stages 3
    python benchmarks/bench_attention.py --kv-cache-dtype fp8   # E4M3 cache (scales 1.0): half the KV bytes

Cases (each checked against ``torch_ref`` before it is timed):
  * decode: 64 requests x 4096-token context, Hq=32, Hkv=8, D=128, paged block 16.
    Reports effective KV-read bandwidth = bytes of K and V read / median time, in TB/s
    and as a fraction of the H200's 4.27 TB/s (eager launch and CUDA-graph replay).
  * prefill: 8 x 2048 new tokens (no prefix), and an extend case (8 x 512 new over a
    1536-token cached prefix). Reports causal attention TFLOP/s (4 * D * Hq per
    attended query-key pair: QK^T and PV) against 799 TFLOP/s.
  * torch_ref vs triton_paged time on a small mixed batch.
Times are ``triton.testing.do_bench`` medians (L2 flushed between runs); each call is
the backend's full ``forward`` (cache write + attention), metadata built once outside.
"""
from __future__ import annotations

import argparse
import random

import torch
import triton

from kvforge.interfaces import AttentionInputs, AttentionLayer
from kvforge.layers.kv_cache_dtype import resolve_kv_cache_dtype
from kvforge_plugins.attention.torch_ref import TorchRefBackend
from kvforge_plugins.attention.triton_paged import TritonPagedBackend, TritonPagedSettings

PEAK_TBPS = 4.27       # H200 HBM3e bandwidth, TB/s
PEAK_TFLOPS = 799.0    # dense bf16/fp16 reference figure, TFLOP/s
DEV = torch.device("cuda")


def make_step(reqs, hq, hkv, d, block_size, dtype, seed=0, kv_dtype=None):
    """Random step over a shuffled paged cache: (inputs, q, k, v, cache), prefixes filled."""
    rng = random.Random(seed)
    need = [-(-(c + n) // block_size) for c, n in reqs]
    nb = sum(need) + 8
    perm = list(range(nb))
    rng.shuffle(perm)
    table = torch.zeros((len(reqs), max(need)), dtype=torch.int32)
    slots, qsl, i = [], [0], 0
    for r, ((c, n), m) in enumerate(zip(reqs, need)):
        blocks = torch.tensor(perm[i:i + m], dtype=torch.int64)
        table[r, :m] = blocks.to(torch.int32)
        pos = torch.arange(c, c + n)
        slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        qsl.append(qsl[-1] + n)
        i += m
    cache = torch.randn((2, nb, block_size, hkv, d), dtype=dtype, device=DEV).to(kv_dtype or dtype)
    t = qsl[-1]
    ctx = torch.tensor([c for c, _ in reqs], dtype=torch.int32)
    qlen = torch.tensor([n for _, n in reqs], dtype=torch.int32)
    inputs = AttentionInputs(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEV), context_lens=ctx.to(DEV),
        seq_lens=(ctx + qlen).to(DEV), block_table=table.to(DEV),
        slot_mapping=torch.cat(slots).to(DEV), max_query_len=int(qlen.max()), max_seq_len=int((ctx + qlen).max()),
        query_lens_cpu=qlen.tolist(), context_lens_cpu=ctx.tolist(), block_size=block_size)
    q = torch.randn((t, hq, d), dtype=dtype, device=DEV)
    k = torch.randn((t, hkv, d), dtype=dtype, device=DEV)
    v = torch.randn((t, hkv, d), dtype=dtype, device=DEV)
    return inputs, q, k, v, cache


def check(backend, layer, step, tol, quiet=False):
    inputs, q, k, v, cache = step
    ref = TorchRefBackend().forward(layer, q, k, v, cache.clone(), inputs).float()
    got = backend.forward(layer, q, k, v, cache.clone(), backend.build_metadata(inputs)).float()
    err = (got - ref).abs().max().item()
    ok = torch.isfinite(got).all().item() and err <= tol * max(1.0, ref.abs().max().item())
    if not quiet or not ok:
        print(f"    correctness vs torch_ref: max abs err {err:.3g} -> {'OK' if ok else 'FAIL'}")
    if not ok:
        raise SystemExit("triton_paged disagrees with torch_ref; not timing")


def time_forward(backend, layer, step, graph=False):
    inputs, q, k, v, cache = step
    md = backend.build_metadata(inputs)
    out = torch.empty_like(q)
    fn = lambda: backend.forward(layer, q, k, v, cache, md, out=out)  # noqa: E731
    fn()
    if graph:
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
    return triton.testing.do_bench(fn, return_mode="median") * 1e-3  # seconds


def causal_pairs(reqs):
    return sum(n * c + n * (n + 1) // 2 for c, n in reqs)


PREFILL_CASES = (("prefill 8 x 2048", [(0, 2048)] * 8), ("extend 8 x 512 over 1536 cached", [(1536, 512)] * 8),
                 ("offline mix: 2 x 1024 new + 254 decodes x 1100", [(0, 1024)] * 2 + [(1100, 1)] * 254))


def sweep_prefill(layer, hq, hkv, d, bs, dtype, tol) -> None:
    """Each launch configuration, checked against torch_ref then timed; TFLOP/s of the prefill
    rows (the mixed case's decode rows run in the same forward)."""
    steps = [(name, reqs, make_step(reqs, hq, hkv, d, bs, dtype)) for name, reqs in PREFILL_CASES]
    best: dict[str, tuple[float, str]] = {}
    for bm in (64, 128):
        for bn in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    label = f"block_m={bm} block_n={bn} warps={warps} stages={stages}"
                    backend = TritonPagedBackend(TritonPagedSettings(
                        prefill_block_m=bm, prefill_block_n=bn, prefill_num_warps=warps, prefill_num_stages=stages))
                    cells = []
                    for name, reqs, step in steps:
                        try:
                            check(backend, layer, step, tol, quiet=True)
                            t = time_forward(backend, layer, step)
                        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: report, go on
                            cells.append(f"{type(e).__name__}")
                            continue
                        pairs = causal_pairs([r for r in reqs if r[1] > 1])
                        tflops = 4 * d * hq * pairs / t / 1e12
                        cells.append(f"{t * 1e3:7.3f} ms {tflops:5.1f} TF")
                        if name not in best or t < best[name][0]:
                            best[name] = (t, label)
                    print(f"{label:44s} | " + " | ".join(cells), flush=True)
    for name, (t, label) in best.items():
        print(f"best for {name}: {label} ({t * 1e3:.3f} ms)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--block-m", type=int, default=64, help="prefill query tile (TritonPagedSettings)")
    ap.add_argument("--block-n", type=int, default=0, help="K/V tile tokens, 0 = auto")
    ap.add_argument("--prefill-block-n", type=int, default=0, help="prefill kernel K/V tile (0 = --block-n's)")
    ap.add_argument("--prefill-warps", type=int, default=0, help="prefill kernel num_warps (0 = auto)")
    ap.add_argument("--prefill-stages", type=int, default=0, help="prefill kernel num_stages (0 = auto)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e5m2"],
                    help="what the cache stores (cache.kv_cache_dtype); bandwidth counts its bytes")
    ap.add_argument("--fp8-dot-dtype", default="float16", choices=["float16", "model"],
                    help="TritonPagedSettings.fp8_dot_dtype (bf16 over an FP8 cache)")
    ap.add_argument("--sweep-prefill", action="store_true",
                    help="time the prefill cases over block_m x block_n x warps x stages, then exit")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention.py needs a CUDA device")
    dtype = getattr(torch, a.dtype)
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    backend = TritonPagedBackend(TritonPagedSettings(prefill_block_m=a.block_m, kv_block_n=a.block_n,
                                                     prefill_block_n=a.prefill_block_n,
                                                     prefill_num_warps=a.prefill_warps,
                                                     prefill_num_stages=a.prefill_stages,
                                                     fp8_dot_dtype=a.fp8_dot_dtype))
    hq, hkv, d, bs = 32, 8, 128, a.block_size
    kv_dtype = resolve_kv_cache_dtype(a.kv_cache_dtype, dtype)
    layer = AttentionLayer(0, hq, hkv, d, d ** -0.5, kv_scale=torch.ones(2, device=DEV))
    elem = torch.empty((), dtype=kv_dtype).element_size()
    print(f"{torch.cuda.get_device_name()}  dtype={a.dtype} kv_cache_dtype={a.kv_cache_dtype} block_size={bs} "
          f"Hq={hq} Hkv={hkv} D={d} block_n={a.block_n} fp8_dot_dtype={a.fp8_dot_dtype}")
    mk = lambda reqs: make_step(reqs, hq, hkv, d, bs, dtype, kv_dtype=kv_dtype)  # noqa: E731
    if a.sweep_prefill:
        sweep_prefill(layer, hq, hkv, d, bs, dtype, tol)
        return

    reqs = [(4095, 1)] * 64
    print("decode 64 x 4096")
    step = mk(reqs)
    check(backend, layer, step, tol)
    kv_bytes = sum(c + n for c, n in reqs) * hkv * d * 2 * elem
    for graph in (False, True):
        t = time_forward(backend, layer, step, graph)
        tbps = kv_bytes / t / 1e12
        print(f"    {'graph' if graph else 'eager'}: {t * 1e6:8.1f} us  KV read {kv_bytes / 2**30:.2f} GiB  "
              f"{tbps:.2f} TB/s = {tbps / PEAK_TBPS:.1%} of {PEAK_TBPS} TB/s")

    for name, reqs in (("prefill 8 x 2048", [(0, 2048)] * 8), ("extend 8 x 512 over 1536 cached", [(1536, 512)] * 8)):
        print(name)
        step = mk(reqs)
        check(backend, layer, step, tol)
        t = time_forward(backend, layer, step)
        tflops = 4 * d * hq * causal_pairs(reqs) / t / 1e12
        print(f"    {t * 1e3:8.3f} ms  {tflops:.1f} TFLOP/s = {tflops / PEAK_TFLOPS:.1%} of {PEAK_TFLOPS:g}")

    reqs = [(1023, 1)] * 6 + [(0, 256), (512, 128)]
    print("small mixed batch (6 decodes x 1024 + 2 prefills): torch_ref vs triton_paged")
    step = mk(reqs)
    check(backend, layer, step, tol)
    t_tri = time_forward(backend, layer, step)
    ref = TorchRefBackend()
    inputs, q, k, v, cache = step
    t_ref = triton.testing.do_bench(lambda: ref.forward(layer, q, k, v, cache, inputs), return_mode="median") * 1e-3
    print(f"    torch_ref {t_ref * 1e3:.3f} ms  triton_paged {t_tri * 1e3:.3f} ms  speedup {t_ref / t_tri:.1f}x")


if __name__ == "__main__":
    main()
