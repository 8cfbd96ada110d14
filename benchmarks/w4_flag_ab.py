"""A / B of one on/off option of the W4A16 mma kernel over the table entries it applies to, in
alternating rounds on one GPU (medians of the rounds, bf16 cuBLAS beside), with each arm's
error against the fp32 reference and whether the two arms gave the same bits:

* ``--flag CLU``: entries that ask for the cluster reduction, CLU 1 vs CLU 0 (the same tiles and
  splits, the partials through global memory; the sums are the same, so the bits must be);
* ``--flag ZF``: entries with SCALE_A 0, ZF 1 (the zero point folded out of the dequantization)
  vs ZF 0 (the numerics differ: fp32 sums of BIAS + q).

``--write PATH`` writes the table with the flag set to the winning arm (gain >= ``--min-gain``) on
each entry to PATH, for ``KVFORGE_QUANT_CHOICES=PATH python benchmarks/w4_table_check.py``.

    python benchmarks/w4_flag_ab.py --flag ZF [--rounds 3] [--write /tmp/table.json]
"""
import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_quant import bench, make_operands, methods, references  # noqa: E402

APPLIES = {"CLU": lambda e: bool(e.get("CLU")), "ZF": lambda e: not e.get("SCALE_A") and not e.get("WG")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flag", choices=sorted(APPLIES), default="CLU")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--write", help="write the table with the flag set per entry to the faster arm here")
    p.add_argument("--min-gain", type=float, default=1.02, help="turn the flag on only when it gains this much")
    a = p.parse_args()
    from kvforge_plugins.quant.kernels import choices
    gpu = torch.cuda.get_device_name()
    table = choices.table_entries("w4_mma", gpu)
    entries = sorted(((k, v) for k, v in table.items() if APPLIES[a.flag](v)), key=lambda kv: kv[0])
    print(f"{len(entries)} table entries for {a.flag} on {gpu}", flush=True)
    chosen = {}
    for key, entry in entries:
        m, n, k = (int(v) for v in key.split("|"))
        ops = make_operands(k, n)
        fns = methods(ops)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = references(ops, x)["w4a16"]
        cfg = {kk: v for kk, v in entry.items() if kk != "schema"}
        times, outs = {1: [], 0: [], "bf16": []}, {}
        for _ in range(a.rounds):
            for on in (1, 0):
                c = {**cfg, a.flag: on}
                outs[on] = fns["w4a16-mma"](x, c)
                times[on].append(bench(lambda v, c=c: fns["w4a16-mma"](v, c), x, True, rep=30))
            times["bf16"].append(bench(fns["bf16"], x, True, rep=30))
        on, off, base = (statistics.median(times[t]) * 1e6 for t in (1, 0, "bf16"))
        err = {t: ((outs[t].float() - ref).abs().max() / ref.abs().max()).item() for t in (1, 0)}
        same = torch.equal(outs[1], outs[0])
        print(f"K={k} N={n} M={m}: {a.flag} 1 {on:6.1f} us ({base / on:.2f}x bf16, err {err[1]:.1e}) | {a.flag} 0 "
              f"{off:6.1f} us ({base / off:.2f}x, err {err[0]:.1e}) | bf16 {base:6.1f} us | gain {off / on:.3f}x | "
              f"same bits {same}", flush=True)
        chosen[key] = {**entry, a.flag: int(off / on >= a.min_gain)}
        del fns, ops
        torch.cuda.empty_cache()
    if a.write:
        data = json.loads(open(choices.table_path()).read())
        data[gpu]["w4_mma"].update(chosen)
        with open(a.write, "w") as f:
            f.write(json.dumps(data, indent=1, sort_keys=True) + "\n")
        print(f"wrote {a.write}: {a.flag} on for {sorted(k for k, e in chosen.items() if e[a.flag])}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
