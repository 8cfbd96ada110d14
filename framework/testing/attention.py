"""Conformance suite for attention backends (``kvforge_register_attention_backends``).

A differential test against the reference backend ``torch_ref``: the backend
under test and ``torch_ref`` get identical inputs — two steps over a paged cache
(step 1 writes the requests' cached prefixes, step 2 is a mixed batch of
prefills, chunked prefills with a cached prefix, decodes at and past block
boundaries, and a request that attends to blocks another request of the same
step fills) — and their outputs must agree within the dtype's tolerance.

Inputs follow the :class:`~kvforge.interfaces.AttentionInputs` contract: block
ids are a random permutation (non-contiguous), block tables are padded with
-1, the cache starts as NaN everywhere (a read of a slot that was never written,
e.g. one position past a causal mask, poisons the output), two layers share one
metadata object (``build_metadata`` once per step), and every output must be
finite.

Shape grid: (num_heads, num_kv_heads, head_size) in (4, 4, 16), (8, 2, 32),
(4, 1, 64) (MHA, GQA 4:1, MQA); block_size 16 and 32; float32 and float16 (and
bfloat16 on CUDA); the ``small`` grid (``--kvforge-grid small``) keeps only
(8, 2, 32) and block size 16. A shape the backend's ``validate()`` rejects is
skipped; a backend that rejects every shape fails (with its reasons), unless it
declares the capability ``devices`` without this run's device type (skipped).

Tolerances, ``|out - ref| <= atol + rtol * |ref|`` with ref in float32:
float32 1e-4 (2e-4 on CUDA), float16 2e-3, bfloat16 1.6e-2.

FP8 KV caches: for each dtype a backend declares in ``kv_cache_dtypes``, the mixed batch
runs again over a cache of that dtype with fresh random per-layer K/V scales
(``AttentionLayer.kv_scale``); ``torch_ref`` writes and reads the same FP8 values, so the same
tolerances apply. A backend declaring none is skipped there.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvforge.testing.harness import Target

HEADS = [(4, 4, 16), (8, 2, 32), (4, 1, 64)]
BLOCK_SIZES = [16, 32]
#: (context_len, query_len) of the step under test; "shared" rows are added per block size.
MIXED = [(0, 17), (40, 1), (16, 33), (5, 2), (0, 1), (33, 1), (31, 1)]
DECODE_ONLY = [(40, 1), (1, 1), (15, 1), (16, 1), (70, 1)]
PREFILL_ONLY = [(0, 23), (0, 1), (0, 48), (0, 16)]


def _tol(dtype, cuda: bool) -> tuple[float, float]:
    import torch
    if dtype == torch.float32:
        return (2e-4, 2e-4) if cuda else (1e-4, 1e-4)
    if dtype == torch.float16:
        return 2e-3, 2e-3
    return 1.6e-2, 1.6e-2


def _dtypes(device) -> list:
    import torch
    out = [torch.float32, torch.float16]
    if device.type == "cuda":
        out.append(torch.bfloat16)
    return out


@dataclass
class _Row:
    ctx: int
    q: int
    blocks: list[int]


def _build_backend(spec, settings: dict):
    from kvforge.engine.builder import validate_plugin_settings
    from kvforge.plugin_manager import build_plugin
    return build_plugin(spec, validate_plugin_settings(spec, dict(settings), "attention.settings"))


def _inputs(rows: list[_Row], first_step: bool, bs: int, device):
    """AttentionInputs for one step; step 1 computes each row's context, step 2 its queries."""
    import torch
    from kvforge.interfaces import AttentionInputs
    spans = [(0, r.ctx) if first_step else (r.ctx, r.q) for r in rows]
    spans_rows = [(r, c, n) for r, (c, n) in zip(rows, spans) if n > 0]
    qsl, ctx_l, slots = [0], [], []
    for r, c, n in spans_rows:
        qsl.append(qsl[-1] + n)
        ctx_l.append(c)
        slots += [r.blocks[p // bs] * bs + p % bs for p in range(c, c + n)]
    width = max(len(r.blocks) for r, _, _ in spans_rows)
    table = torch.full((len(spans_rows), width), -1, dtype=torch.int32)
    for i, (r, _, _) in enumerate(spans_rows):
        table[i, :len(r.blocks)] = torch.tensor(r.blocks, dtype=torch.int32)
    qlens = [n for _, _, n in spans_rows]
    return AttentionInputs(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        context_lens=torch.tensor(ctx_l, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([c + n for c, n in zip(ctx_l, qlens)], dtype=torch.int32, device=device),
        block_table=table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(qlens), max_seq_len=max(c + n for c, n in zip(ctx_l, qlens)),
        query_lens_cpu=qlens, context_lens_cpu=ctx_l, block_size=bs)


def _rows(shape: list[tuple[int, int]], bs: int, gen, shared: bool) -> tuple[list[_Row], int]:
    """Assign random non-contiguous blocks; with ``shared``, add a writer row (0, 40) and a
    reader row whose context is the writer's first full blocks, both in the step under test."""
    import torch
    rows = [_Row(c, n, []) for c, n in shape]
    reader_ctx = 0
    if shared:
        reader_ctx = (40 // bs) * bs
        rows += [_Row(0, 40, []), _Row(reader_ctx, 3, [])]
    need = [-(-(r.ctx + r.q) // bs) for r in rows]
    if shared:
        need[-1] -= reader_ctx // bs
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    at = 0
    for r, k in zip(rows, need):
        r.blocks, at = perm[at:at + k], at + k
    if shared:
        rows[-1].blocks = rows[-2].blocks[:reader_ctx // bs] + rows[-1].blocks
    return rows, num_blocks


def _reads_shared(row: _Row, rows: list[_Row], shared: bool) -> bool:
    return shared and row is rows[-1]


def _run(backend, rows: list[_Row], shared: bool, num_blocks: int, bs: int, heads, window: int | None,
         in_dtype, run_dtype, device, seed: int, layers: int = 2, kv_dtype=None, scales=None):
    """Both steps through ``backend``: inputs drawn in ``in_dtype`` (from ``seed``) and cast to
    ``run_dtype``; returns ``(step, layer, output float32 on CPU, inputs)`` for every step and layer.
    ``kv_dtype``: the cache's dtype (default ``run_dtype``); ``scales``: per layer K/V scales
    (float32 [2]) of an FP8 cache."""
    import torch
    from kvforge.interfaces import AttentionLayer
    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(seed)
    caches = [torch.full(backend.kv_cache_shape(num_blocks, bs, hkv, d), float("nan"), device=device)
              .to(kv_dtype or run_dtype) for _ in range(layers)]
    outs = []
    for step, first in enumerate((True, False)):
        # Step 1 fills contexts, except the shared reader's (the writer fills it in step 2).
        step_rows = [r for r in rows if not (first and _reads_shared(r, rows, shared))]
        if not any((r.ctx if first else r.q) for r in step_rows):
            continue
        inputs = _inputs(step_rows, first, bs, device)
        t = int(inputs.query_start_loc[-1])
        meta = backend.build_metadata(inputs)
        for li in range(layers):
            layer = AttentionLayer(li, hq, hkv, d, d ** -0.5, window,
                                   kv_scale=None if scales is None else scales[li].to(device))
            q, k, v = (torch.randn(t, h, d, generator=gen).to(in_dtype).to(device=device, dtype=run_dtype)
                       for h in (hq, hkv, hkv))
            out = backend.forward(layer, q, k, v, caches[li], meta)
            outs.append((step, li, out.float().cpu(), inputs))
    return outs


def _compare(target: Target, shape, bs: int, heads, dtype, window: int | None, tag: str, device, seed: int,
             rejected: list[str], kv_dtype=None) -> bool:
    """Run one grid point against torch_ref; False if the backend's validate() rejects it.
    ``kv_dtype``: an FP8 cache dtype (default: the model dtype's cache)."""
    import torch
    from kvforge.interfaces import AttentionRequirements
    hq, hkv, d = heads
    from kvforge.engine.builder import validate_plugin_settings
    from kvforge.plugin_manager import validate_backend
    req = AttentionRequirements(dtype, d, hq, hkv, bs, kv_dtype or dtype, window,
                                validate_plugin_settings(target.spec, dict(target.settings), "attention.settings"))
    reasons = validate_backend(target.spec, req, device)
    if reasons:
        rejected.append(f"{str(dtype).removeprefix('torch.')} block_size={bs} heads={heads} window={window}: "
                        f"{'; '.join(reasons)}")
        return False
    shared = shape is MIXED
    gen = torch.Generator().manual_seed(seed)
    rows, num_blocks = _rows(shape, bs, gen, shared)
    scales = [2.0 ** (torch.rand(2, generator=gen) * 4 - 2) for _ in range(2)] if kv_dtype is not None else None
    got = _run(_build_backend(target.spec, target.settings), rows, shared, num_blocks, bs, heads, window,
               dtype, dtype, device, seed + 1, kv_dtype=kv_dtype, scales=scales)
    ref = _run(_build_backend(target.registry.get("attention", "torch_ref"), {}), rows, shared, num_blocks, bs,
               heads, window, dtype, torch.float32, device, seed + 1, kv_dtype=kv_dtype, scales=scales)
    atol, rtol = _tol(dtype, device.type == "cuda")
    for (step, li, out, inputs), (_, _, want, _) in zip(got, ref):
        where = (f"{tag}: {str(dtype).removeprefix('torch.')} kv_cache={str(kv_dtype or dtype).removeprefix('torch.')} "
                 f"block_size={bs} heads(q,kv,d)={heads} window={window} "
                 f"step {step + 1} layer {li}, rows (context_len, query_len)="
                 f"{list(zip(inputs.context_lens_cpu, inputs.query_lens_cpu))}")
        if out.shape != want.shape:
            raise AssertionError(f"{where}: output shape {tuple(out.shape)}, expected {tuple(want.shape)}")
        if not torch.isfinite(out).all():
            bad = (~torch.isfinite(out)).nonzero()[0].tolist()
            raise AssertionError(f"{where}: non-finite output at [token, head, dim]={bad} (a read of a cache slot "
                                 f"that was never written, or an output row never written)")
        err = (out - want).abs() - (atol + rtol * want.abs())
        if (err > 0).any():
            tok = int((err > 0).nonzero()[0][0])
            row = int(torch.searchsorted(inputs.query_start_loc.cpu(), torch.tensor(tok), right=True)) - 1
            raise AssertionError(f"{where}: differs from torch_ref beyond atol={atol}, rtol={rtol}: max |diff| "
                                 f"{(out - want).abs().max():.3g}, first at token {tok} (row {row})")
    return True


def _grid(target: Target, shape, what: str, window: int | None = None, heads_list=None,
          block_sizes=None, kv_dtype=None) -> tuple[int, list[str]]:
    import pytest
    rng, tag = target.rng(what)
    device = target.torch_device()
    devices = target.capabilities.get("devices")
    if devices is not None and device.type not in devices:
        pytest.skip(f"{target} declares devices={tuple(devices)!r}; this run is on {device.type}")
    if target.grid == "small":
        heads_list = heads_list or HEADS[1:2]
        block_sizes = block_sizes or BLOCK_SIZES[:1]
    rejected: list[str] = []
    ran = 0
    for dtype in _dtypes(device):
        for bs in block_sizes or BLOCK_SIZES:
            for heads in heads_list or HEADS:
                ran += _compare(target, shape, bs, heads, dtype, window, tag, device, rng.randrange(1 << 30),
                                rejected, kv_dtype)
    return ran, rejected


def _require_some(target: Target, ran: int, rejected: list[str], what: str) -> None:
    if ran == 0:
        raise AssertionError(f"{target}: validate() rejected every shape of the {what} grid on "
                             f"{target.torch_device()}, so nothing could be checked:\n  " + "\n  ".join(rejected))
    print(f"{target} {what}: {ran} shapes checked, {len(rejected)} rejected by validate()")


def check_mixed_batch_numerics(target: Target) -> None:
    """Prefills, chunked prefills over cached prefixes, decodes, same-step shared blocks."""
    ran, rejected = _grid(target, MIXED, "mixed")
    _require_some(target, ran, rejected, "mixed-batch")


def check_decode_only_and_prefill_only(target: Target) -> None:
    """Pure-decode and pure-prefill steps (the fast paths many kernels special-case)."""
    ran, rejected = _grid(target, DECODE_ONLY, "decode-only")
    ran2, rejected2 = _grid(target, PREFILL_ONLY, "prefill-only")
    _require_some(target, ran + ran2, rejected + rejected2, "decode-only / prefill-only")


def check_sliding_window(target: Target) -> None:
    """Sliding-window attention (window 24) on the mixed batch, where the backend accepts it."""
    import pytest
    ran, rejected = _grid(target, MIXED, "sliding-window", window=24, heads_list=[(8, 2, 32)], block_sizes=[16])
    if ran == 0:
        pytest.skip(f"{target}: validate() rejects sliding windows here: {rejected[:1]}")


def check_fp8_kv_cache(target: Target) -> None:
    """The mixed batch over each FP8 cache dtype the backend declares (``kv_cache_dtypes``),
    with random per-layer scales, against torch_ref over the same FP8 cache."""
    import pytest

    from kvforge.layers.kv_cache_dtype import FP8_KV_DTYPES
    declared = target.capabilities.get("kv_cache_dtypes") or ()
    if not declared:
        pytest.skip(f"{target} declares no kv_cache_dtypes (FP8 KV caches are optional)")
    for name in declared:
        ran, rejected = _grid(target, MIXED, f"fp8-cache {name}", heads_list=[(8, 2, 32)], block_sizes=[16],
                              kv_dtype=FP8_KV_DTYPES[name])
        _require_some(target, ran, rejected, f"FP8 cache ({name})")


CHECKS = [check_mixed_batch_numerics, check_decode_only_and_prefill_only, check_sliding_window, check_fp8_kv_cache]
