"""GPTQ act-order (``desc_act: true``, a permuted ``g_idx``) under tensor parallelism.

A row-parallel layer (o_proj, down_proj) gives each rank 1/tp of the input rows, but an
act-order group's rows are spread over all of them, so each rank keeps the scales and
zero points of every group and its slice of ``g_idx`` (global group numbers), as vLLM does
(``plugins/quant/act_order.py``). Checked here:

* layer level, two simulated ranks in one process (``parallel_state`` set by hand, as in
  test_parallel_layers.py): the ranks' partial products sum to the unsplit layer's output
  and to ``x @ W_ref``; a trivial g_idx keeps its split scales (desc_act false) or trims the
  whole ones back to the rank's groups (desc_act true); one group (``group_size: -1``) loads;
  a permuted g_idx under desc_act false on a split is refused, naming the tensor; with the
  kernel backend, rows of spread groups fall back to the reference, rows that fill whole
  groups keep the pairs layout with scales of their own groups;
* end to end: stories260K in GPTQ 4-bit act-order, TP=2 (gloo workers) vs TP=1 prompt logits.

Each test's random inputs come from a fresh seed printed in its messages.
"""
from __future__ import annotations

import pytest
import torch

from helpers import prompt_logits, rel_err, urandom_seed
from kvforge_plugins.quant.kernels import HAS_TRITON
from test_quant_fixtures import build_gptq, dequant, pack_along_cols, pack_along_rows, rtn_groups

PREFIX = "model.layers.0.self_attn.o_proj"
TP = 2


def _checkpoint(k, n, bits, group, g_idx, gen):
    """GPTQ v1 asymmetric tensors of a random [K, N] W^T and its dequantized W_ref [K, N]."""
    gs = k if group == -1 else group
    wt = torch.randn(k, n, generator=gen)
    q, s, z = rtn_groups(wt, bits, g_idx, -(-k // gs), sym=False, min_zero=1)
    tensors = {"qweight": pack_along_rows(q, bits), "qzeros": pack_along_cols(z - 1, bits), "scales": s,
               "g_idx": g_idx.to(torch.int32)}
    return tensors, dequant(q, s, z, g_idx)


def _row_layer(tensors, rank, tp, bits, group, desc_act, dtype=torch.float32, backend="reference"):
    """The row-parallel layer of ``rank`` of ``tp``, loaded the way the model loader does it."""
    from kvforge.distributed import parallel_state as ps
    from kvforge.layers.parallel_linear import RowParallelLinear
    from kvforge_plugins.quant.gptq import GPTQConfig, GPTQSettings
    qc = GPTQConfig({"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": False},
                    GPTQSettings(backend=backend))
    k, n = tensors["g_idx"].shape[0], tensors["scales"].shape[1]
    ps.set_parallel_state(ps.ParallelState(rank, tp, rank, tp, 0, 1, None, None, False, torch.device("cpu"), "gloo")
                          if tp > 1 else None)
    try:
        layer = RowParallelLinear(k, n, False, qc, PREFIX, dtype)
        for name, t in tensors.items():
            layer.load(name, t, None)
        layer.method.process_weights_after_loading(layer)
    finally:
        ps.set_parallel_state(None)
    return layer


def _split_outputs(tensors, x, bits, group, desc_act, **kw):
    """(per-rank layers, sum of the ranks' partial products x_r @ W_r) -- the all-reduce."""
    kl = x.shape[1] // TP
    layers = [_row_layer(tensors, r, TP, bits, group, desc_act, **kw) for r in range(TP)]
    y = sum(lay.method.apply(lay, x[:, r * kl:(r + 1) * kl].to(kw.get("dtype", torch.float32)), None).float()
            for r, lay in enumerate(layers))
    return layers, y


def _perm_g_idx(k, gs, gen):
    g = torch.empty(k, dtype=torch.int64)
    g[torch.randperm(k, generator=gen)] = torch.arange(k) // gs
    return g


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 16)])
def test_act_order_row_parallel_sums_to_unsplit(bits, group):
    seed = urandom_seed()
    gen = torch.Generator().manual_seed(seed % 2 ** 63)
    k, n = 128, 64
    tensors, w_ref = _checkpoint(k, n, bits, group, _perm_g_idx(k, group, gen), gen)
    x = torch.randn(5, k, generator=gen)
    full = _row_layer(tensors, 0, 1, bits, group, True)
    y_full = full.method.apply(full, x, None)
    layers, y = _split_outputs(tensors, x, bits, group, True)
    tag = f"{bits}-bit group {group} (seed {seed})"
    for r, lay in enumerate(layers):  # every group kept: the rank's rows use groups of all ranks
        assert tuple(lay.scales.shape) == (k // group, n), f"{tag} rank {r}: scales {tuple(lay.scales.shape)}"
        assert lay.g_idx_ref is not None, f"{tag} rank {r}: act-order not honoured"
    assert rel_err(y, y_full) <= 1e-5, f"{tag}: TP={TP} rel_err {rel_err(y, y_full):.3g} vs the unsplit layer"
    assert rel_err(y, x @ w_ref) <= 1e-5, f"{tag}: rel_err {rel_err(y, x @ w_ref):.3g} vs x @ W_ref"


@pytest.mark.parametrize("desc_act", [False, True])
def test_trivial_g_idx_row_parallel_keeps_split_scales(desc_act):
    """desc_act false: scales split by group as before; true: the whole ones trimmed back."""
    seed = urandom_seed()
    gen = torch.Generator().manual_seed(seed % 2 ** 63)
    k, n, group = 128, 64, 32
    tensors, w_ref = _checkpoint(k, n, 4, group, torch.arange(k) // group, gen)
    x = torch.randn(3, k, generator=gen)
    layers, y = _split_outputs(tensors, x, 4, group, desc_act)
    for r, lay in enumerate(layers):
        assert torch.equal(lay.scales.float(), tensors["scales"][r * 2:(r + 1) * 2].float()), f"rank {r} (seed {seed})"
        assert lay.g_idx_ref is None and lay.perm is None, f"rank {r}: taken for act-order (seed {seed})"
    assert rel_err(y, x @ w_ref) <= 1e-5, f"desc_act {desc_act}: rel_err {rel_err(y, x @ w_ref):.3g} (seed {seed})"


@pytest.mark.parametrize("desc_act", [False, True])
def test_per_channel_row_parallel(desc_act):
    """group_size -1: one group, its scales [1, N] on every rank (not split 1/tp)."""
    seed = urandom_seed()
    gen = torch.Generator().manual_seed(seed % 2 ** 63)
    k, n = 64, 32
    tensors, w_ref = _checkpoint(k, n, 8, -1, torch.zeros(k, dtype=torch.int64), gen)
    x = torch.randn(3, k, generator=gen)
    _, y = _split_outputs(tensors, x, 8, -1, desc_act)
    assert rel_err(y, x @ w_ref) <= 1e-5, f"rel_err {rel_err(y, x @ w_ref):.3g} (seed {seed})"


def test_permuted_g_idx_without_desc_act_refused_on_a_split():
    gen = torch.Generator().manual_seed(urandom_seed() % 2 ** 63)
    tensors, _ = _checkpoint(64, 32, 4, 16, _perm_g_idx(64, 16, gen), gen)
    for rank in range(TP):
        with pytest.raises(ValueError, match=rf"{PREFIX}\.g_idx: g_idx is an act-order permutation but "
                                             r"quantization_config\.desc_act is false"):
            _row_layer(tensors, rank, TP, 4, 16, False)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (the kernel path's preparation; no kernel runs here)")
def test_kernel_path_preparation_row_parallel():
    """backend triton, fp16, group 64 (the pairs layout's): spread groups fall back to the
    reference with all scales; groups permuted within each rank's rows keep the kernel path,
    the pairs layout and only the rank's scales. Outputs from ``dequantized`` (torch)."""
    seed = urandom_seed()
    gen = torch.Generator().manual_seed(seed % 2 ** 63)
    k, n, group = 256, 64, 64
    kl = k // TP
    within = torch.cat([r * 2 + _perm_g_idx(kl, group, gen) for r in range(TP)])  # each rank: its 2 groups
    x = torch.randn(3, k, generator=gen).half()
    for name, g_idx, kernel in (("spread", _perm_g_idx(k, group, gen), False), ("within", within, True)):
        tensors, w_ref = _checkpoint(k, n, 4, group, g_idx, gen)
        tag = f"{name} (seed {seed})"
        for r in range(TP):
            lay = _row_layer(tensors, r, TP, 4, group, True, dtype=torch.float16, backend="triton")
            assert lay.wna16_kernel == kernel, f"{tag} rank {r}: wna16_kernel {lay.wna16_kernel}"
            assert lay.wna16_layout == ("pairs" if kernel else "checkpoint"), f"{tag} rank {r}: {lay.wna16_layout}"
            assert lay.scales.shape[0] == (k if not kernel else kl) // group, f"{tag} rank {r}: scales"
            xr = x[:, r * kl:(r + 1) * kl]
            if kernel:  # the kernel's contract: x gathered with perm times the repacked weight
                y = xr[:, lay.perm].float() @ lay.method.dequantized(lay, torch.float32)
            else:
                y = lay.method.apply(lay, xr, None).float()
            want = xr.float() @ w_ref[r * kl:(r + 1) * kl]
            assert rel_err(y, want) <= 2e-3, f"{tag} rank {r}: rel_err {rel_err(y, want):.3g}"


def test_tp2_act_order_stories_matches_tp1(tmp_path):
    """stories260K, GPTQ 4-bit group 32 act-order (MLP kept dense: 172 is not a multiple of 8):
    every o_proj is row-parallel on TP=2; prompt logits agree with TP=1 to float rounding."""
    from kvforge import LLM
    d = build_gptq(tmp_path / "gptq4_act", 4, 32, sym=False, desc_act=True, skip_regex=".*mlp.*")
    # (gloo ranks on the CPU: a one-GPU machine cannot hold TP = 2 on CUDA)
    common = dict(model=str(d), num_gpu_blocks=32, max_num_batched_tokens=64, dtype="float32", device="cpu")
    ref = LLM(**common)
    llm = LLM(**common, tensor_parallel_size=2)
    try:
        ids = [ref.get_tokenizer().encode(p) for p in ("Once upon a time, there was a little girl", "Tom had a")]
        for want, have in zip(prompt_logits(ref.llm_engine, ids), prompt_logits(llm.llm_engine, ids)):
            assert rel_err(have, want) <= 1e-5, f"TP=2 prompt logits rel_err {rel_err(have, want):.3g} vs TP=1"
    finally:
        llm.llm_engine.executor.shutdown()


def test_tp_quant_config_errors_before_workers_start(tmp_path, monkeypatch):
    """A quantization config the quantizer refuses (here bits 3) fails in the driver, with the
    quantizer's one-line message, before any worker process starts (workers would print their
    tracebacks first)."""
    import json
    from kvforge import LLM
    from kvforge.distributed import launch
    from test_quant_fixtures import build_awq
    d = build_awq(tmp_path / "awq")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["bits"] = 3
    (d / "config.json").write_text(json.dumps(cfg))
    started = []
    monkeypatch.setattr(launch, "build_parallel_parts", lambda *a, **k: started.append(1))
    with pytest.raises(ValueError, match="awq: 3-bit weights are not supported"):
        LLM(model=str(d), num_gpu_blocks=32, dtype="float32", device="cpu", tensor_parallel_size=2)
    assert not started


def test_tp_load_errors_read_as_on_one_rank(tmp_path, caplog):
    """A checkpoint tensor the workers refuse while loading (online fp8 of a NaN weight) is raised
    once, as a ValueError naming the tensor; no worker traceback or executor error is logged at
    WARNING or above (they read as noise around a bad-input message)."""
    import re

    from kvforge import LLM
    from test_quant_fixtures import STORIES
    from test_quant_formats import _rewrite
    # k_proj of stories260K: 32 rows, rows 16..31 on rank 1; the error gives the checkpoint's row
    name, row = "model.layers.1.self_attn.k_proj.weight", 16 + int(torch.randint(16, (1,)))

    def edit(st):
        t = st[name].clone()
        t[row, 3] = float("nan")
        st[name] = t
    d = _rewrite(STORIES, tmp_path / "nan", edit_tensors=edit)
    with caplog.at_level("WARNING"):
        with pytest.raises(ValueError, match=re.escape(f"checkpoint tensor '{name}' has non-finite values (first in "
                                                       f"row {row};")):
            LLM(model=str(d), num_gpu_blocks=32, dtype="float32", device="cpu", quantization="fp8",
                tensor_parallel_size=2)
    assert "Traceback" not in caplog.text and "distributed executor failed" not in caplog.text, caplog.text


def test_tp_config_warnings_print_once(tmp_path, caplog, capfd, monkeypatch):
    """A quantizer's config warning (GPTQ without ``desc_act``: assumed false) is logged once, by
    the driver's config check, not again by each worker that rebuilds the same config; a warning
    a worker logs later, while loading (``int4_layout`` on the reference backend), still shows."""
    import json

    from kvforge import LLM
    d = build_gptq(tmp_path / "gptq4", 4, 32, sym=False, desc_act=False, skip_regex=".*mlp.*")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["quantization_config"]["desc_act"]
    (d / "config.json").write_text(json.dumps(cfg))
    msg = "quantization_config.desc_act missing"
    # spawned workers write to this test's fd 2 (a forkserver started by an earlier test would
    # hand its children that test's captured stderr)
    from kvforge.distributed import mp
    monkeypatch.setenv(mp.START_METHOD_ENV, "spawn")
    with caplog.at_level("WARNING"):
        llm = LLM(model=str(d), num_gpu_blocks=32, dtype="float32", device="cpu", tensor_parallel_size=2,
                  kv_cache_dtype="fp8")
        llm.llm_engine.executor.shutdown()
    workers = capfd.readouterr().err  # (worker processes log to their stderr, this test's fd 2)
    assert caplog.text.count(msg) == 1, caplog.text
    assert msg not in workers, workers
    assert workers.count("the checkpoint has no K/V scales") == 2, workers
