"""How far the ``triton_paged`` prefill kernel is from torch's attention kernels on the engine's
prefill shape (a script, not a test).

    python benchmarks/prefill_headroom.py [--ab OTHER_prefill_kernel.py ...] [--lens 1024,2048]

Why: in the offline benchmark's mixed steps (8 fresh 1024-token prompts a step, Llama-3-8B
shape) the prefill kernel is the one kernel not at a hardware floor (session 19's profile:
5.7% of the step). This prints, for 8 prompts of each length (GQA 32/8, D 128, bf16, block 16):

  * ``triton_paged`` forward (cache write + attention) for several prefill launch configs;
  * with ``--ab FILE`` (repeatable): the same forward with the prefill kernel module loaded from
    each FILE (other versions of ``prefill_kernel.py``), all alternated 5 times, medians;
  * torch ``scaled_dot_product_attention`` (flash, cuDNN, memory-efficient backends, each if it
    runs) on the same q/k/v as [B, H, S, D], causal, GQA.

Every result is checked against ``torch_ref`` (bf16 tolerance 2e-2 of the largest value) first.
TFLOP/s = 4 * D * Hq * (attended query-key pairs) / median time; ``triton.testing.do_bench``.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import causal_pairs, check, make_step, time_forward  # noqa: E402

from kvforge.interfaces import AttentionLayer  # noqa: E402
from kvforge_plugins.attention.triton_paged import TritonPagedBackend, TritonPagedSettings  # noqa: E402

HQ, HKV, D, BS, TOL = 32, 8, 128, 16, 2e-2
CONFIGS = ((64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 3))


def tflops(reqs, t: float) -> float:
    return 4 * D * HQ * causal_pairs(reqs) / t / 1e12


def sdpa_cases(step, n: int, s: int):
    """(label, fn) for each SDPA backend; q/k/v copied out of the step as [n, H, s, D]."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    _, q, k, v, _ = step
    qb = q.view(n, s, HQ, D).transpose(1, 2).contiguous()
    kb = k.view(n, s, HKV, D).transpose(1, 2).contiguous()
    vb = v.view(n, s, HKV, D).transpose(1, 2).contiguous()
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                     ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def fn(be=be):
            with sdpa_kernel(be):
                return torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
        yield f"sdpa {name}", fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lens", default="1024,2048", help="prompt lengths, 8 prompts each")
    ap.add_argument("--ab", action="append", default=[], help="another prefill_kernel.py to time against the "
                    "installed one (repeatable)")
    a = ap.parse_args()
    layer = AttentionLayer(layer_idx=0, num_heads=HQ, num_kv_heads=HKV, head_size=D, scale=D ** -0.5)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  bf16")
    others = []
    for i, path in enumerate(a.ab):
        spec = importlib.util.spec_from_file_location(f"prefill_kernel_ab{i}", path)
        others.append(importlib.util.module_from_spec(spec))
        spec.loader.exec_module(others[-1])
    for s in (int(x) for x in a.lens.split(",")):
        reqs = [(0, s)] * 8
        step = make_step(reqs, HQ, HKV, D, BS, torch.bfloat16)
        print(f"== 8 x {s} fresh prompts")
        for bm, bn, w, st in CONFIGS:
            be = TritonPagedBackend(TritonPagedSettings(prefill_block_m=bm, prefill_block_n=bn,
                                                        prefill_num_warps=w, prefill_num_stages=st))
            check(be, layer, step, TOL, quiet=True)
            t = time_forward(be, layer, step)
            print(f"  triton_paged m{bm} n{bn} w{w} s{st}: {t * 1e6:8.1f} us {tflops(reqs, t):6.1f} TFLOP/s")
        if others:
            arms = [("installed", TritonPagedBackend())]
            for path, mod in zip(a.ab, others):
                arms.append((path, TritonPagedBackend()))
                arms[-1][1]._prefill = mod
                check(arms[-1][1], layer, step, TOL, quiet=True)
            times: dict[str, list[float]] = {name: [] for name, _ in arms}
            for _ in range(5):
                for name, be in arms:
                    times[name].append(time_forward(be, layer, step))
            base = statistics.median(times["installed"])
            for name, ts in times.items():
                t = statistics.median(ts)
                print(f"  A/B default config, {name}: {t * 1e6:8.1f} us {tflops(reqs, t):6.1f} TFLOP/s "
                      f"({t / base:.3f} x installed)")
        ref = None
        for label, fn in sdpa_cases(step, 8, s):
            try:
                out = fn()
            except RuntimeError as e:
                print(f"  {label}: does not run ({str(e).splitlines()[0][:100]})")
                continue
            ref = ref if ref is not None else TritonPagedBackend().forward(
                layer, step[1], step[2], step[3], step[4].clone(), TritonPagedBackend().build_metadata(step[0]))
            err = (out.transpose(1, 2).reshape(-1, HQ, D).float() - ref.float()).abs().max().item()
            t = triton.testing.do_bench(fn, return_mode="median") * 1e-3
            print(f"  {label}: {t * 1e6:8.1f} us {tflops(reqs, t):6.1f} TFLOP/s (max abs diff to triton_paged {err:.3g})")


if __name__ == "__main__":
    torch.manual_seed(0)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    main()
