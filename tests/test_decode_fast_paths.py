"""The vectorized pure-decode paths (scheduler + paged allocator + runner inputs, issue 4's
CPU-overhead work) must give exactly what the general per-request paths give.

Two identical engines' worth of scheduler/allocator/runner are driven with the same
random workload (arrivals, shared prefixes, EOS and stop ids, max_tokens, aborts, a KV
cache small enough to preempt); one has the fast paths switched off. Every step's
scheduled requests, block tables, prepared tensors and outputs must match.
"""
from __future__ import annotations

import random

import pytest
import torch

from kvforge.bench.sim import build_scheduler
from kvforge.config import EngineConfig
from kvforge.engine.model_runner import ModelRunner
from kvforge.engine.request import Request, RequestStatus
from kvforge.engine.sampling_params import SamplingParams
from kvforge.plugin_manager import load_registry


def _build(registry, fast: bool, num_blocks: int):
    cfg = EngineConfig.from_sources(None, {
        "model": "unused-no-weights", "scheduler": "chunked_prefill", "enable_prefix_caching": True,
        "block_size": 4, "max_num_seqs": 24, "max_num_batched_tokens": 64})
    sched, alloc = build_scheduler(cfg, registry, num_blocks, 96, 0)
    backend = registry.get("attention", "torch_ref").factory(None)
    runner = ModelRunner(None, backend, alloc, [], torch.device("cpu"))
    if not fast:
        sched._decode_batch.available = False
        runner._decode_inputs = None
    return sched, alloc, runner


def _inputs(runner, so):
    ids, pos, inp, qsl, rows, n, reqs, ph = runner._prepare(so, None)
    return ([ids, pos, inp.query_start_loc, inp.context_lens, inp.seq_lens, inp.block_table, inp.slot_mapping, rows],
            (inp.max_query_len, inp.max_seq_len, inp.query_lens_cpu, inp.context_lens_cpu, list(qsl), n,
             [r.request_id for r in reqs]))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_fast_paths_match_general_paths(seed):
    registry = load_registry()
    rng = random.Random(seed)
    num_blocks = 40 if seed % 2 else 400  # odd seeds: tight cache, so preemption happens
    engines = [_build(registry, fast, num_blocks) for fast in (True, False)]
    prefixes = [[rng.randrange(3, 50) for _ in range(rng.choice((4, 8, 9)))] for _ in range(3)]
    took_fast = 0
    next_id = 0
    for step in range(160):
        if step < 100 and rng.random() < 0.3:
            for _ in range(rng.randint(1, 4)):
                prompt = rng.choice(prefixes) + [rng.randrange(3, 50) for _ in range(rng.randint(1, 9))]
                sp = SamplingParams(temperature=0.0, max_tokens=rng.randint(2, 30),
                                    stop_token_ids=[rng.randrange(3, 50)] if rng.random() < 0.3 else None,
                                    min_tokens=rng.choice((0, 0, 2)))
                for sched, _, _ in engines:
                    sched.add_request(Request(f"r{next_id}", list(prompt), sp, sp.max_tokens, frozenset({2})))
                next_id += 1
        if rng.random() < 0.05:
            victim = f"r{rng.randrange(max(next_id, 1))}"
            for sched, _, _ in engines:
                sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
        outs = [sched.schedule() for sched, _, _ in engines]
        a, b = outs
        assert [r.request_id for r in a.scheduled] == [r.request_id for r in b.scheduled], step
        assert a.num_scheduled_tokens == b.num_scheduled_tokens, step
        assert [r.request_id for r in a.preempted] == [r.request_id for r in b.preempted], step
        took_fast += a.decode_batch is not None
        for r in a.scheduled:
            assert engines[0][1].get_block_table(r.request_id) == engines[1][1].get_block_table(r.request_id), step
        if a.scheduled:
            (ta, ma), (tb, mb) = _inputs(engines[0][2], a), _inputs(engines[1][2], b)
            assert ma == mb, step
            for x, y in zip(ta, tb):
                assert x.dtype == y.dtype and torch.equal(x, y), step
        if a.scheduled and rng.random() < 0.1:  # ended between schedule and update (abort, stop string)
            victim = rng.choice(a.scheduled).request_id
            for sched, _, _ in engines:
                sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
        toks = [rng.choice((2, 5, 6, 7, 8)) if rng.random() < 0.1 else rng.randrange(5, 50) for _ in a.scheduled]
        done = []
        for (sched, _, _), so in zip(engines, outs):
            counts = so.num_scheduled_tokens
            sampled = {r.request_id: [t] for r, t in zip(so.scheduled, toks)
                       if r.num_computed_tokens + counts[r.request_id] >= r.num_tokens}
            done.append([(r.request_id, r.status, r.stop_reason) for r in sched.update(so, sampled)])
        assert done[0] == done[1], step
        ra = {rid: (r.output_token_ids, r.num_computed_tokens, r.status) for rid, r in engines[0][0].requests.items()}
        rb = {rid: (r.output_token_ids, r.num_computed_tokens, r.status) for rid, r in engines[1][0].requests.items()}
        assert ra == rb, step
        sa, sb = engines[0][1].stats(), engines[1][1].stats()
        assert sa == sb and engines[0][1].num_free_blocks == engines[1][1].num_free_blocks, step
    assert took_fast > 10  # the fast path was exercised


def test_block_table_array_mirrors_tables():
    """After allocations, rollbacks and frees, each row equals the list table, zero-padded."""
    registry = load_registry()
    sched, alloc, _ = _build(registry, True, 200)
    rng = random.Random(7)
    reqs = []
    for i in range(12):
        r = Request(f"q{i}", [rng.randrange(3, 50) for _ in range(rng.randint(1, 20))], SamplingParams(max_tokens=50), 50)
        assert alloc.allocate_slots(r, r.num_tokens, num_lookahead_tokens=rng.randint(0, 6)) is not None
        r.num_computed_tokens = r.num_tokens
        reqs.append(r)
    for r in reqs[::3]:
        alloc.free_tail(r, r.num_computed_tokens)
    for r in reqs[1::4]:
        alloc.free(r)
    arr = alloc.table_array
    for rid, table in alloc._tables.items():
        row = arr.row_of[rid]
        assert arr.lens[row] == len(table)
        assert arr.table[row, :len(table)].tolist() == table
        assert not arr.table[row, len(table):].any()
        assert arr.marks[row] == alloc._num_registered.get(rid, 0)
    assert set(arr.row_of) == set(alloc._tables)
