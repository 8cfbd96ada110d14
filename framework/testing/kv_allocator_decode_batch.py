"""Allocator conformance: the optional vectorized-decode capability (``table_array`` and
``allocate_decodes``, see docs/plugins.md) must behave exactly like ``allocate_slots``."""
from __future__ import annotations

from kvforge.testing.harness import Target
from kvforge.testing.kv_allocator import _request, make_allocator


def check_decode_batch_capability(target: Target) -> None:
    """Allocators with the optional vectorized-decode capability (``table_array`` and
    ``allocate_decodes``): ``allocate_decodes`` must do exactly what ``allocate_slots(r, 1)``
    one request at a time does (a twin allocator is driven that way), refuse without
    changes when short of blocks, and ``table_array`` must mirror ``get_block_table``.
    Passes trivially for an allocator without the capability."""
    probe = make_allocator(target, 4, 4, prefix_caching=False)
    if not (hasattr(probe, "allocate_decodes") and hasattr(probe, "table_array")):
        return  # optional; without it the general per-request paths are used, nothing to check
    import numpy as np
    rng, tag = target.rng("decode batch")
    bs = 4
    prefix = target.capabilities.get("prefix_caching") is True
    batch, single = (make_allocator(target, 48, bs, prefix_caching=prefix) for _ in range(2))
    heads = [[1] + [rng.choice((3, 4)) for _ in range(rng.choice((2, 5, 9)))] for _ in range(3)]
    live: list[tuple] = []  # (request in `batch`, its twin in `single`)
    counter = 0

    def fail(msg: str) -> None:
        raise AssertionError(f"{target} {tag}: {msg}")

    def mirror_ok(a) -> None:
        arr = a.table_array
        for r, _ in live:
            table = a.get_block_table(r.request_id)
            row = arr.row_of[r.request_id]
            if arr.table[row, :len(table)].tolist() != table or arr.lens[row] != len(table):
                fail(f"table_array row of {r.request_id} differs from get_block_table {table}")

    for _ in range(80):
        while len(live) < 8 and rng.random() < 0.5:  # admit with a whole-prompt prefill
            toks = rng.choice(heads) + [rng.choice((3, 4, 5)) for _ in range(rng.randrange(1, 6))]
            pair = (_request(f"b{counter}", toks), _request(f"b{counter}", toks))
            counter += 1
            for a, r in zip((batch, single), pair):
                r.num_computed_tokens = a.get_computed_tokens(r)
            if pair[0].num_computed_tokens != pair[1].num_computed_tokens:
                fail("the two allocators' prefix-cache hits differ after identical histories")
            if any(a.allocate_slots(r, r.num_tokens - r.num_computed_tokens) is None
                   for a, r in zip((batch, single), pair)):
                for a, r in zip((batch, single), pair):
                    a.free(r)
                break
            for r in pair:
                r.num_computed_tokens = r.num_tokens - 1  # its last token is this step's decode
            live.append(pair)
        if not live:
            continue
        reqs = [p[0] for p in live]
        rows = batch.table_array.rows([r.request_id for r in reqs])
        free_before = batch.num_free_blocks
        tables_before = [list(batch.get_block_table(r.request_id)) for r in reqs]
        ok = batch.allocate_decodes(reqs, rows, np.asarray([r.num_computed_tokens + 1 for r in reqs], dtype=np.int64))
        if not ok:
            if batch.num_free_blocks != free_before or \
                    tables_before != [batch.get_block_table(r.request_id) for r in reqs]:
                fail("allocate_decodes returned False but changed the tables")
        else:
            for _, twin in live:
                if single.allocate_slots(twin, 1) is None:
                    fail("allocate_decodes succeeded where allocate_slots one by one runs out of blocks")
            for r, twin in live:
                if batch.get_block_table(r.request_id) != single.get_block_table(twin.request_id):
                    fail(f"{r.request_id}: table {batch.get_block_table(r.request_id)} after allocate_decodes, "
                         f"{single.get_block_table(twin.request_id)} after allocate_slots")
            if batch.num_free_blocks != single.num_free_blocks:
                fail(f"{batch.num_free_blocks} free blocks after allocate_decodes, {single.num_free_blocks} after "
                     "allocate_slots")
            tok = rng.choice((3, 4))
            for pair in live:
                for r in pair:
                    r.num_computed_tokens += 1
                    r.output_token_ids.append(tok)
        mirror_ok(batch)
        for pair in list(live):  # finish some (always some when short of blocks)
            if rng.random() < (0.5 if not ok else 0.08):
                live.remove(pair)
                batch.free(pair[0])
                single.free(pair[1])
    for r, twin in live:
        batch.free(r)
        single.free(twin)
    if batch.num_free_blocks != batch.num_blocks:
        fail(f"{batch.num_blocks - batch.num_free_blocks} blocks leaked")
