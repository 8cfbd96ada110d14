"""A / B of the cluster reduction (config CLU): every table entry that asks for it, timed with
CLU 1 and CLU 0 (the same tiles and splits, the partials through global memory) in alternating
rounds on one GPU; medians of the rounds, bf16 cuBLAS beside. Says whether a CLU entry's gain
comes from the cluster or from its tiles.

    python benchmarks/w4_cluster_ab.py [--rounds 3]
"""
import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_quant import bench, make_operands, methods  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    from kvforge_plugins.quant.kernels.choices import table_entries
    table = table_entries("w4_mma", torch.cuda.get_device_name())
    entries = sorted(((k, v) for k, v in table.items() if v.get("CLU")), key=lambda kv: kv[0])
    print(f"{len(entries)} table entries with CLU on {torch.cuda.get_device_name()}", flush=True)
    for key, entry in entries:
        m, n, k = (int(v) for v in key.split("|"))
        fns = methods(make_operands(k, n))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        cfg = {kk: v for kk, v in entry.items() if kk != "schema"}
        times = {1: [], 0: [], "bf16": []}
        for _ in range(a.rounds):
            for clu in (1, 0):
                times[clu].append(bench(lambda v, c={**cfg, "CLU": clu}: fns["w4a16-mma"](v, c), x, True, rep=30))
            times["bf16"].append(bench(fns["bf16"], x, True, rep=30))
        on, off, ref = (statistics.median(times[t]) * 1e6 for t in (1, 0, "bf16"))
        print(f"K={k} N={n} M={m}: CLU 1 {on:6.1f} us ({ref / on:.2f}x bf16) | CLU 0 {off:6.1f} us "
              f"({ref / off:.2f}x) | bf16 {ref:6.1f} us | cluster gain {off / on:.3f}x", flush=True)
        del fns
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
