"""NCCL all-reduce latency between the GPUs of this host, eager and inside a CUDA graph.

The tensor-parallel decode step all-reduces the hidden states twice per layer (64 times
for a 32-layer model), so at small batch this latency, not bandwidth, bounds what TP can
save. For each message (bf16 [rows, --hidden]) it times ``--ops`` back-to-back all-reduces
with CUDA events, eagerly and replaying a graph that captured them, and prints the median
microseconds per all-reduce over ``--repeats`` and the bus bandwidth (NCCL's definition:
2 (n - 1) / n x bytes / time). ``--symm-mem`` adds torch's symmetric-memory all-reduces
(``torch.ops.symm_mem``: peers read each other's buffer over NVLink), copy-in included.

    python benchmarks/bench_allreduce.py --world 2 --rows 1,16,64,256
"""
from __future__ import annotations

import argparse
import json
import os
import statistics


def _time(fn, ops: int, repeats: int) -> tuple[float, float]:
    """Median microseconds per call of ``fn``, eager and replayed from a CUDA graph of ``ops`` calls."""
    import torch
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    eager, graph = [], []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(ops):
            fn()
        b.record()
        torch.cuda.synchronize()
        eager.append(1e3 * a.elapsed_time(b) / ops)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # a collective's first call on a stream sets it up outside the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=s):
            for _ in range(ops):
                fn()
    torch.cuda.synchronize()
    for _ in range(repeats + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        graph.append(1e3 * a.elapsed_time(b) / ops)
    return statistics.median(eager), statistics.median(graph[2:])


def _rank_main(rank: int, args, port: int) -> None:
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world,
                            device_id=torch.device("cuda", rank))
    results = []
    rows_list = [int(r) for r in args.rows.split(",")]
    big, gname = None, None
    if args.symm_mem:
        try:  # one buffer for every size: each size uses a view of its first rows
            import torch.distributed._symmetric_memory as symm_mem
            gname = dist.group.WORLD.group_name
            big = symm_mem.empty(max(rows_list), args.hidden, dtype=torch.bfloat16, device="cuda")
            symm_mem.rendezvous(big, gname)
        except Exception as e:  # noqa: BLE001 - reported; NCCL is still timed
            big = None
            if rank == 0:
                print(f"symm_mem unavailable: {type(e).__name__}: {e}")
    for rows in rows_list:
        x = torch.randn(rows, args.hidden, dtype=torch.bfloat16, device="cuda")
        ways = {"nccl": lambda: dist.all_reduce(x)}
        if big is not None:
            buf = big[:rows]
            out = torch.empty_like(x)

            def one_shot():
                buf.copy_(x)
                torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", gname, out)

            def two_shot():
                buf.copy_(x)
                torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", gname)
            # Correctness first: each must equal NCCL's sum (a view's offset must be honoured).
            ref = x.clone()
            dist.all_reduce(ref)
            one_shot()
            err1 = (out.float() - ref.float()).abs().max().item()
            two_shot()
            err2 = (buf.float() - ref.float()).abs().max().item()
            if rank == 0:
                print(f"rows {rows}: max |symm_mem - nccl| one-shot {err1:.3g}, two-shot {err2:.3g}")
            ways.update({"symm_mem one-shot": one_shot, "symm_mem two-shot": two_shot})
        nbytes = x.numel() * x.element_size()
        for name, fn in ways.items():
            try:
                e_us, g_us = _time(fn, args.ops, args.repeats)
            except Exception as e:  # noqa: BLE001
                if rank == 0:
                    print(f"{name} rows {rows}: {type(e).__name__}: {str(e)[:200]}")
                continue
            results.append({"way": name, "rows": rows, "bytes": nbytes, "eager_us": e_us, "graph_us": g_us,
                            "graph_busbw_GBs": 2 * (args.world - 1) / args.world * nbytes / g_us / 1e3})
    if rank == 0:
        print(f"| all-reduce | rows x {args.hidden} bf16 | bytes | eager us | CUDA-graph us | graph bus GB/s |")
        print("|---|---|---|---|---|---|")
        for r in results:
            print(f"| {r['way']} | {r['rows']} | {r['bytes']} | {r['eager_us']:.1f} | {r['graph_us']:.1f} "
                  f"| {r['graph_busbw_GBs']:.0f} |")
        if args.output_json:
            with open(args.output_json, "w") as f:
                json.dump({"args": vars(args), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "nccl": ".".join(map(str, torch.cuda.nccl.version())), "results": results}, f, indent=2)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--rows", default="1,16,64,256", help="comma-separated token counts")
    p.add_argument("--ops", type=int, default=64, help="all-reduces per timed run (a 32-layer step has 64)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--symm-mem", action="store_true",
                   help="also time torch's symmetric-memory one-shot / two-shot all-reduce (NVLink P2P)")
    p.add_argument("--output-json")
    args = p.parse_args(argv)
    import torch.multiprocessing as mp

    from kvforge.distributed.mp import free_port
    mp.start_processes(_rank_main, args=(args, free_port()), nprocs=args.world, start_method="spawn")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
