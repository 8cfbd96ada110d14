"""``kvforge bench serve``: load-test a running OpenAI-compatible server.

Method (as vLLM's ``benchmark_serving``): ``--num-prompts`` streaming completion requests
are sent with inter-arrival times drawn from a gamma distribution with mean
``1 / --request-rate`` seconds and shape ``--burstiness`` (1.0 = a Poisson process;
``inf`` rate = all at once), optionally capped at ``--max-concurrency`` in flight. For
each request the client records:

* TTFT: send to first non-empty text chunk (s);
* ITL: gaps between consecutive text chunks (s);
* TPOT: (E2E - TTFT) / (output tokens - 1) (s);
* E2E latency: send to ``[DONE]`` (s).

Output tokens come from the server's streamed usage. The report gives mean / median /
p90 / p99 of each (in milliseconds) and request, output-token and total-token throughput
(per second of wall time); ``--result-file`` writes it as JSON.

The ``random`` dataset builds prompts of ``--input-len`` token ids (± ``--range-ratio``)
from tokens the server's ``/tokenize`` returns for a fixed text, so every id is in the
vocabulary and the prompt length is exact; outputs are ``--output-len`` tokens with
``ignore_eos`` (± ``--range-ratio``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

_SEED_TEXT = ("Once upon a time there was a little girl named Lily who loved to play in the park with her "
              "friends. One day she saw a big red ball under a tree, and the sun was warm and happy. The cat "
              "and the dog ran to the garden to find a small bird that could sing a beautiful song.")


@dataclass
class RequestResult:
    """Timings of one request (seconds) and its token counts."""

    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    """Flags of ``kvforge bench serve``."""
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL")
    p.add_argument("--endpoint", default="/v1/completions", help="completions endpoint path")
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--api-key", default=None, help="bearer token (default: $KVFORGE_API_KEY, as kvforge serve)")
    p.add_argument("--dataset", default="random", choices=["random"], help="prompt source")
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send (default 100)")
    p.add_argument("--input-len", type=int, default=32, help="prompt length in tokens (default 32)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens per request (default 64)")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths are uniform in [len*(1-r), len*(1+r)] (default 0: fixed)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (default inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly the output length (default on)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and arrival times")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--result-file", default=None, help="write the report as JSON here")
    p.add_argument("--disable-tqdm", action="store_true")


def _lengths(rng: random.Random, base: int, ratio: float, n: int) -> list[int]:
    lo, hi = max(1, int(base * (1 - ratio))), max(1, int(base * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


async def _headers(args) -> dict[str, str]:
    key = args.api_key or os.environ.get("KVFORGE_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


async def build_prompts(client, args, rng: random.Random) -> list[tuple[Any, int, int]]:
    """``(prompt, prompt_len, max_tokens)`` per request."""
    pool: list[int] = []
    try:
        r = await client.post("/tokenize", json={"prompt": _SEED_TEXT, "add_special_tokens": False})
        if r.status_code == 200:
            pool = sorted(set(r.json()["tokens"]))
    except Exception:  # noqa: BLE001 - fall back to text prompts
        pool = []
    in_lens = _lengths(rng, args.input_len, args.range_ratio, args.num_prompts)
    out_lens = _lengths(rng, args.output_len, args.range_ratio, args.num_prompts)
    words = _SEED_TEXT.split()
    out = []
    for il, ol in zip(in_lens, out_lens):
        prompt: Any = [rng.choice(pool) for _ in range(il)] if pool else " ".join(rng.choices(words, k=il))
        out.append((prompt, il, ol))
    return out


async def _one(client, args, model: str, prompt: Any, prompt_len: int, max_tokens: int) -> RequestResult:
    res = RequestResult(prompt_len=prompt_len)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": args.temperature, "ignore_eos": args.ignore_eos,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with client.stream("POST", args.endpoint, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"].get("message"))
                    return res
                if obj.get("usage"):
                    res.output_tokens = obj["usage"].get("completion_tokens", res.output_tokens)
                text = "".join(c.get("text") or (c.get("delta") or {}).get("content") or ""
                               for c in obj.get("choices", []))
                if text:
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
        res.latency = time.perf_counter() - start
        res.output_tokens = res.output_tokens or chunks
        res.ok = chunks > 0
        if not res.ok:
            res.error = "no text received"
    except Exception as e:  # noqa: BLE001 - a failed request is reported, not fatal
        res.error = f"{type(e).__name__}: {e}"
    return res


def _stats(values: list[float], name: str) -> dict[str, float]:
    import numpy as np
    arr = np.asarray(values, dtype=float) * 1000.0 if values else np.zeros(1)
    return {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
            f"p90_{name}_ms": float(np.percentile(arr, 90)), f"p99_{name}_ms": float(np.percentile(arr, 99))}


def summarize(results: list[RequestResult], duration: float, args) -> dict[str, Any]:
    """The benchmark report (times in ms, throughputs per second)."""
    ok = [r for r in results if r.ok]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    report: dict[str, Any] = {
        "base_url": args.base_url, "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "completed": len(ok),
        "failed": len(results) - len(ok), "duration_s": duration, "total_input_tokens": in_tok,
        "total_output_tokens": out_tok, "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tok / duration if duration else 0.0,
        "total_token_throughput": (in_tok + out_tok) / duration if duration else 0.0}
    report.update(_stats([r.ttft for r in ok], "ttft"))
    report.update(_stats(tpots, "tpot"))
    report.update(_stats([x for r in ok for x in r.itl], "itl"))
    report.update(_stats([r.latency for r in ok], "e2el"))
    report["errors"] = sorted({r.error for r in results if r.error})[:10]
    return report


async def benchmark(args) -> dict[str, Any]:
    """Run the benchmark; returns the report (see :func:`summarize`)."""
    import httpx
    from tqdm.auto import tqdm

    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.max_concurrency or max(1, args.num_prompts),
                          max_keepalive_connections=args.max_concurrency or max(1, args.num_prompts))
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout, limits=limits,
                                 headers=await _headers(args)) as client:
        model = args.model
        if model is None:
            r = await client.get("/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        prompts = await build_prompts(client, args, rng)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = tqdm(total=len(prompts), desc="requests", disable=args.disable_tqdm, dynamic_ncols=True)

        async def run(item) -> RequestResult:
            if sem is None:
                res = await _one(client, args, model, *item)
            else:
                async with sem:
                    res = await _one(client, args, model, *item)
            bar.update(1)
            return res

        tasks = []
        start = time.perf_counter()
        for item in prompts:
            tasks.append(asyncio.ensure_future(run(item)))
            if math.isfinite(args.request_rate) and args.request_rate > 0:
                theta = 1.0 / (args.request_rate * args.burstiness)
                await asyncio.sleep(rng.gammavariate(args.burstiness, theta))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    report = summarize(list(results), duration, args)
    report["model"] = model
    return report


def print_report(report: dict[str, Any]) -> None:
    if report["completed"] == 0:  # (a table of zero latencies would read as a result)
        print(f"no request completed ({report['failed']} failed)")
        for err in report.get("errors", []):
            print(f"error: {err}")
        return
    print("=" * 20 + " Serving Benchmark Result " + "=" * 20)
    for key, value in report.items():
        if key == "errors":
            continue
        print(f"{key:<36}{value:>14.2f}" if isinstance(value, float) else f"{key:<36}{str(value):>14}")
    for err in report.get("errors", []):
        print(f"error: {err}")


def run_bench_serve(args: argparse.Namespace) -> int:
    """Entry point of ``kvforge bench serve``; returns 0 if every request succeeded."""
    import httpx
    try:
        report = asyncio.run(benchmark(args))
    except httpx.HTTPStatusError as e:  # (the set-up calls: /v1/models, /tokenize)
        hint = "; pass --api-key or set KVFORGE_API_KEY" if e.response.status_code == 401 else ""
        print(f"kvforge bench serve: error: {e.request.method} {e.request.url} answered "
              f"{e.response.status_code}{hint}", file=sys.stderr)
        return 1
    except httpx.TransportError as e:
        print(f"kvforge bench serve: error: cannot reach the server at {args.base_url}: {type(e).__name__}: {e}",
              file=sys.stderr)
        return 1
    print_report(report)
    if args.result_file:
        with open(args.result_file, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0 if report["failed"] == 0 else 1


__all__ = ["add_bench_serve_args", "run_bench_serve", "benchmark", "summarize", "RequestResult"]
