"""Wide launch-config sweep of the mma W4A16 kernel (``kernels/w4_mma.py``), KW included:
8 tilings x 5 pipelines x 3 split rules per shape and M, each checked against the
dequantized reference (relative error < 2e-2) and timed in CUDA graphs; the top 3 are
re-timed (best of 3 medians) against the choices table's entry and stored in the table
where they beat it by >= 2%. A copy of the table goes to $OUT (device tool) or /tmp.

    python benchmarks/sweep_w4_mma.py 4096x28672,14336x4096,4096x6144,4096x4096,14336x14336 1,16

(``bench_quant.py --tune-mma`` times a shorter candidate list, ``quant_tuning.mma_candidates``.)
"""
import itertools
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
from bench_quant import GROUP, bench, make_operands, methods
from kvforge_plugins.quant.kernels import w4_mma
from kvforge_plugins.quant.kernels.choices import key, write_table
from kvforge_plugins.quant.kernels.wna16 import dequantize_wna16

shapes = [tuple(map(int, s.split("x"))) for s in sys.argv[1].split(",")]
ms = [int(v) for v in sys.argv[2].split(",")]
modes = [dict(S=1, CPA=0), dict(S=2, CPA=0), dict(S=1, CPA=3), dict(S=1, CPA=4), dict(S=1, CPA=6)]
tiles = [(1, 8, 8), (1, 16, 16), (2, 8, 4), (2, 8, 8), (4, 4, 4), (4, 8, 4), (2, 4, 2), (1, 8, 4)]
gpu = torch.cuda.get_device_name()
best_all = {gpu: {"w4_mma": {}}}
for k, n in shapes:
    ops = make_operands(k, n)
    fns = methods(ops)
    w_ref = dequantize_wna16(ops["awq_qweight"], ops["awq_scales"], ops["awq_zeros"], bits=4, group_size=GROUP,
                             pack_k=False, awq_order=True, dtype=torch.float32)
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ w_ref
        tb = bench(fns["bf16"], x, True)
        td = min(bench(fns["w4a16-mma"], x, True) for _ in range(3))
        base = dict(w4_mma.CONFIGS[w4_mma.bucket(m)])
        res = []
        t0 = time.time()
        for (tw, wa, kw), mode, wv in itertools.product(tiles, modes, (1, 2, 4)):
            cfg = {**base, **mode, "TW": tw, "WARPS": wa, "KW": kw, "waves": wv, "LDW": 1, "MINB": 1,
                   "SCALE_A": False, "XS": 0}
            try:
                y = fns["w4a16-mma"](x, cfg)
                rel = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                assert rel < 2e-2, rel
                t = bench(lambda v, c=cfg: fns["w4a16-mma"](v, c), x, True, rep=20)
            except Exception as e:
                print("  skip", cfg, type(e).__name__, str(e)[:80]); continue
            res.append((t, cfg))
        res.sort(key=lambda r: r[0])
        # re-time the top 3 (noise) against the table's entry
        top = [(min(bench(lambda v, c=c: fns["w4a16-mma"](v, c), x, True) for _ in range(3)), c) for _, c in res[:3]]
        top.sort(key=lambda r: r[0])
        by = (k * n // 2 + (k // GROUP) * n * 6)
        print(f"K={k} N={n} M={m}: bf16 {tb*1e6:.1f} us, table {td*1e6:.1f} us ({tb/td:.2f}x); sweep {time.time()-t0:.0f}s")
        for t, c in top:
            print(f"   {t*1e6:6.1f} us {tb/t:5.2f}x {by/t/1e12:5.2f} TB/s " + " ".join(f"{q}={c[q]}" for q in ("TW", "WARPS", "KW", "S", "CPA", "waves")))
        for t, c in res[3:10]:
            print(f"   ({t*1e6:6.1f} us) " + " ".join(f"{q}={c[q]}" for q in ("TW", "WARPS", "KW", "S", "CPA", "waves")))
        if top and top[0][0] < 0.98 * td:
            best_all[gpu]["w4_mma"][key(m, n, k)] = {**top[0][1], "schema": w4_mma.TABLE_SCHEMA}
            print(f"   -> stored ({td / top[0][0]:.3f}x the table's)", flush=True)
p = write_table(best_all)
shutil.copy(p, os.path.join(os.environ.get("OUT", "/tmp"), "gemm_choices.json"))
