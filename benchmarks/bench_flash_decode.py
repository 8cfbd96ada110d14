"""Benchmark the `flash_decode` backend (CUDA C++ via NVRTC) on CUDA; a script, not a test.

    python benchmarks/bench_flash_decode.py            # the four cases below
    python benchmarks/bench_flash_decode.py --sweep    # also time each case per plan knob

``--sweep`` re-times each case with explicit split counts (:data:`SWEEP_SPLITS`) and, with
``--sweep-knobs``, the plan's ``FILL`` and ``MIN_PARTITION_TOKENS`` varied (the rest of the
backend unchanged) and, for each setting, inside a CUDA graph as well
(``graph`` column: launch gaps removed, as in a captured decode step).

Cases (GQA 32/8, head_dim 128, bf16, block 16), each checked against torch_ref first:
  * batch 64 x 4096 context  (issue 3 target: >= 3.4 TB/s effective KV read)
  * batch 1 x 32768 context  (issue 3 target: >= 3.0 TB/s through split-KV)
  * batch 8 x 8192 and batch 256 x 1024 (no target)
Effective bandwidth = bytes of K and V read (seq_len x Hkv x D x 2 x 2 bytes per row) /
median time of the attention call (the call includes the KV write of the step's token and,
when split, fd_merge), vs the measured 4.27 TB/s: eager launches (triton.testing.do_bench)
and replayed from a CUDA graph (do_bench_cudagraph; launch gaps removed, as in the engine's
captured decode steps); and the attention kernels alone (fd_partial + fd_merge replayed from
a graph, without the KV write), which is what "the decode attention kernel" target names.
``splits`` is the plan the backend's forward uses (plan.plan_splits).
"""
from __future__ import annotations

import argparse
import random

import torch
import triton

from kvforge.interfaces import AttentionInputs, AttentionLayer
import kvforge_plugins.attention.flash_decode as fd_backend
import kvforge_plugins.attention.flash_decode.plan as fd_plan
from kvforge_plugins.attention.flash_decode import FlashDecodeBackend
from kvforge_plugins.attention.flash_decode.plan import plan_splits
from kvforge_plugins.attention.torch_ref import TorchRefBackend

PEAK_TBPS = 4.27
DEV = torch.device("cuda")


def case(batch: int, ctx: int, hq=32, hkv=8, d=128, bs=16, dtype=torch.bfloat16, sweep=False, knobs=False,
         triton_too=False):
    nblk = -(-ctx // bs)
    total = batch * nblk + 1
    perm = torch.randperm(total - 1)
    table = perm[: batch * nblk].view(batch, nblk).to(torch.int32)
    cache = torch.randn(2, total, bs, hkv, d, dtype=dtype, device=DEV)
    q = torch.randn(batch, hq, d, dtype=dtype, device=DEV)
    k = torch.randn(batch, hkv, d, dtype=dtype, device=DEV)
    v = torch.randn(batch, hkv, d, dtype=dtype, device=DEV)
    pos = ctx - 1
    slots = table[:, pos // bs].long() * bs + pos % bs
    i32 = dict(dtype=torch.int32, device=DEV)
    inputs = AttentionInputs(torch.arange(batch + 1, **i32), torch.full((batch,), ctx - 1, **i32),
                             torch.full((batch,), ctx, **i32), table.to(DEV), slots.to(DEV), 1, ctx, [1] * batch,
                             [ctx - 1] * batch, bs)
    layer = AttentionLayer(0, hq, hkv, d, d ** -0.5)
    be = FlashDecodeBackend()
    md = be.build_metadata(inputs)
    out = be.forward(layer, q, k, v, cache, md)
    if batch * ctx <= 64 * 4096:
        ref = TorchRefBackend().forward(layer, q, k, v, cache.clone(), inputs)
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < 2e-2, err
    else:
        err = float("nan")
    ms = triton.testing.do_bench(lambda: be.forward(layer, q, k, v, cache, md), warmup=50, rep=300,
                                 return_mode="median")
    with torch.cuda.stream(torch.cuda.Stream()):
        g_ms = triton.testing.do_bench_cudagraph(lambda: be.forward(layer, q, k, v, cache, md), rep=300,
                                                 return_mode="median")
    # The attention kernels alone (fd_partial + fd_merge), without the step's KV write.
    splits, partition = be.plan_for(md, layer)
    part_out, part_lse = be._ws(md.num_decode, hq, splits, d, q.device)
    kout = torch.empty_like(q)

    def kernels_only():
        be.kernels.decode(q, cache, inputs.block_table, inputs.seq_lens, md.decode_tok, md.decode_req,
                          md.num_decode, layer, bs, splits, partition, part_out, part_lse, kout)
    with torch.cuda.stream(torch.cuda.Stream()):
        k_ms = triton.testing.do_bench_cudagraph(kernels_only, rep=300, return_mode="median")
    nbytes = batch * ctx * hkv * d * 2 * cache.element_size()
    tbps, g_tbps, k_tbps = (nbytes / (t * 1e-3) / 1e12 for t in (ms, g_ms, k_ms))
    print(f"flash_decode batch {batch:3d} x ctx {ctx:6d} heads {hq}/{hkv}: eager {ms * 1e3:7.1f} us {tbps:5.2f} TB/s "
          f"({tbps / PEAK_TBPS:5.1%} of {PEAK_TBPS}); CUDA graph {g_ms * 1e3:7.1f} us {g_tbps:5.2f} TB/s "
          f"({g_tbps / PEAK_TBPS:5.1%}); kernels alone (graph, no KV write) {k_ms * 1e3:7.1f} us "
          f"{k_tbps:5.2f} TB/s  splits={splits} rel_err={err:.1e}")
    if triton_too:  # the same step through triton_paged (one program per row and KV head, no split)
        from kvforge_plugins.attention.triton_paged import TritonPagedBackend
        tp = TritonPagedBackend()
        tmd = tp.build_metadata(inputs)
        with torch.cuda.stream(torch.cuda.Stream()):
            t_ms = triton.testing.do_bench_cudagraph(lambda: tp.forward(layer, q, k, v, cache, tmd), rep=300,
                                                     return_mode="median")
        print(f"  triton_paged, same step: CUDA graph {t_ms * 1e3:7.1f} us "
              f"{nbytes / (t_ms * 1e-3) / 1e12:5.2f} TB/s (flash_decode / triton_paged time {g_ms / t_ms:.2f})")
    if sweep:
        run_sweep(be, layer, q, k, v, cache, inputs, nbytes, knobs)
    return tbps


def md_splits(be, layer, inputs) -> int:
    """The split count the backend's forward plans for this batch (plan_splits as patched now)."""
    return be.plan_for(be.build_metadata(inputs), layer)[0]


SWEEP_SPLITS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 33, 40, 48, 49, 56, 64, 66)


def time_setting(be, layer, q, k, v, cache, inputs, nbytes, label: str) -> None:
    md = be.build_metadata(inputs)
    fn = lambda: be.forward(layer, q, k, v, cache, md)  # noqa: E731
    ms = triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")
    with torch.cuda.stream(torch.cuda.Stream()):
        g_ms = triton.testing.do_bench_cudagraph(fn, rep=150, return_mode="median")
    splits = md_splits(be, layer, inputs)
    tb, gtb = (nbytes / (t * 1e-3) / 1e12 for t in (ms, g_ms))
    print(f"    {label} splits {splits:4d}: eager {ms * 1e3:7.1f} us {tb:5.2f} TB/s   "
          f"graph {g_ms * 1e3:7.1f} us {gtb:5.2f} TB/s", flush=True)


def run_sweep(be, layer, q, k, v, cache, inputs, nbytes, knobs: bool):
    """Time one case for each explicit split count and (``knobs``) each plan setting
    (``FILL``, ``MIN_PARTITION_TOKENS``), eager and in a CUDA graph."""
    saved = fd_plan.FILL, fd_plan.MIN_PARTITION_TOKENS
    try:
        for want in SWEEP_SPLITS:  # explicit split counts, partitions a multiple of the block size only
            bs, seq = inputs.block_size, inputs.max_seq_len
            part = -(-(-(-seq // want)) // bs) * bs
            fd_backend.plan_splits = lambda *a, _p=part, **kw: (-(-seq // _p), _p)
            time_setting(be, layer, q, k, v, cache, inputs, nbytes, f"splits~{want:3d} part {part:5d}")
        fd_backend.plan_splits = plan_splits
        for fill in (1, 2, 3, 4) if knobs else ():
            for min_part in (128, 256, 512, 1024):
                fd_plan.FILL, fd_plan.MIN_PARTITION_TOKENS = fill, min_part
                time_setting(be, layer, q, k, v, cache, inputs, nbytes, f"fill {fill} min_part {min_part:5d}")
    finally:
        fd_plan.FILL, fd_plan.MIN_PARTITION_TOKENS = saved
        fd_backend.plan_splits = plan_splits


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="also time each case per plan knob")
    ap.add_argument("--sweep-knobs", action="store_true", help="with --sweep: also vary FILL/MIN_PARTITION_TOKENS")
    ap.add_argument("--cases", default="64x4096,1x32768,8x8192,256x1024", help="BATCHxCTX list")
    ap.add_argument("--heads", default="32/8", help="HQ/HKV per GPU (a TP=2 rank of Llama-3-8B: 16/4)")
    ap.add_argument("--triton-too", action="store_true", help="also time triton_paged on each case (CUDA graph)")
    args = ap.parse_args()
    random.seed(0)
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    hq, hkv = map(int, args.heads.split("/"))
    for b, c in (tuple(map(int, bc.split("x"))) for bc in args.cases.split(",")):
        case(b, c, hq=hq, hkv=hkv, sweep=args.sweep, knobs=args.sweep_knobs, triton_too=args.triton_too)
