"""Conformance suite for quantizers (``kvforge_register_quantizers``).

The core check builds real :class:`~kvforge.layers.linear.FusedLinear` layers
through the quantizer (``factory(hf_quant_config, settings)`` ->
``get_linear_method(prefix)`` -> ``create_weights``), loads checkpoint-format
tensors shard by shard with the parameters' own ``weight_loader`` (as the model
loader does), calls ``process_weights_after_loading`` and compares ``apply`` with
the dequantized reference ``x @ W_deq^T + b`` computed in float32; for the gate|up
layer also ``silu_and_mul`` (``LinearMethod.apply_silu_and_mul`` where the method fuses
it) with silu(gate) * up of that reference; and every layer's ``forward_prenorm`` (the
method's ``apply_add_rmsnorm`` where it has one) with the reference of RMSNorm(x + residual),
the q|k|v layer (a ``QKVParallelLinear`` with ``rope_heads`` set, as Llama builds it) also
with its q and k heads rotated.

Checkpoint formats are the quantizer's own business, so a quantizer provides
the test weights through a small optional protocol on its ``LinearMethod``::

    def make_test_weights(self, input_size: int, output_sizes: list[int],
                          params_dtype: torch.dtype, generator: torch.Generator
                          ) -> dict[str, list[torch.Tensor]]:
        # checkpoint parameter name ("weight", "qweight", "scales", ...) -> one
        # checkpoint-format tensor per output shard, as they appear in a checkpoint

    def dequantize_test_weights(self, tensors: dict[str, list[torch.Tensor]],
                                input_size: int, output_sizes: list[int]) -> torch.Tensor:
        # float32 [sum(output_sizes), input_size]: what the GEMM must compute with

and optionally ``test_rtol`` (float, or dict dtype name -> float): the allowed
``max|y - ref| / max|ref|`` (default 1e-4 float32, 5e-3 float16, 3e-2 bfloat16).
The quantizer factory may list the ``quantization_config`` dicts to test in an
attribute ``conformance_quant_configs`` (default ``[None]``).

A dense method (one floating ``weight`` [N, K] parameter, like ``unquantized``)
needs none of this: random normal rows are its checkpoint format and the weight
is its own dequantization. A quantizer with another format (or one that quantizes a
dense weight online in ``process_weights_after_loading``) and no protocol is
reported as skipped, "NOT CHECKED", with a message pointing here.
"""
from __future__ import annotations

from typing import Any

from kvforge.testing.harness import Target, assert_drained

#: (prefix, input_size, output_sizes): a plain, a 3-way fused and a 2-way fused projection.
LAYERS = [("model.layers.0.self_attn.o_proj", 128, [64]),
          ("model.layers.0.self_attn.qkv_proj", 128, [64, 32, 32]),
          ("model.layers.0.mlp.gate_up_proj", 256, [128, 128])]
NUM_TOKENS = [1, 5, 33]
DEFAULT_RTOL = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}


def _dtypes(device):
    import torch
    out = [torch.float32, torch.float16]
    if device.type == "cuda":
        out.append(torch.bfloat16)
    return out


def _quant_config(target: Target, hf_cfg: dict | None):
    from kvforge.engine.builder import validate_plugin_settings
    from kvforge.plugin_manager import build_plugin
    spec = target.spec
    settings = validate_plugin_settings(spec, dict(target.settings), "quantization.settings")
    try:
        return build_plugin(spec, hf_cfg, settings)
    except ValueError as e:
        import pytest
        pytest.skip(f"{target}: NOT CHECKED: its factory refuses quantization_config={hf_cfg!r} ({e}); list the "
                    f"configs to test in the factory attribute conformance_quant_configs (see docs/plugins.md)")


def _dense_protocol(layer, input_size: int, output_sizes: list[int]):
    """The default protocol of a dense method, or None if the layer is not dense."""
    import torch
    params = {n: p for n, p in layer.named_parameters(recurse=False) if n != "bias"}
    w = params.get("weight")
    if set(params) != {"weight"} or not w.is_floating_point() or tuple(w.shape) != (sum(output_sizes), input_size):
        return None

    def make(input_size, output_sizes, params_dtype, generator):
        return {"weight": [torch.randn(n, input_size, generator=generator) * input_size ** -0.5
                           for n in output_sizes]}

    def deq(tensors, input_size, output_sizes):
        return torch.cat([t.to(w.dtype).float() for t in tensors["weight"]])

    return make, deq


def _no_protocol(target: Target, method, layer) -> None:
    import pytest
    names = sorted(f"{n}:{str(p.dtype).removeprefix('torch.')}{list(p.shape)}"
                   for n, p in layer.named_parameters(recurse=False))
    pytest.skip(f"{target}: NOT CHECKED: {type(method).__name__} is not a dense method (parameters after loading: "
                f"{names}) and does not implement the conformance protocol make_test_weights / "
                f"dequantize_test_weights (see kvforge.testing.quantizer and docs/plugins.md)")


def check_linear_matches_dequantized_reference(target: Target) -> None:
    import torch
    from kvforge.layers.linear import FusedLinear
    from kvforge.layers.parallel_linear import MergedColumnParallelLinear, QKVParallelLinear
    rng, tag = target.rng("linear")
    device = target.torch_device()
    configs = list(getattr(target.spec.factory, "conformance_quant_configs", None) or [None])
    ran, rejected = 0, []
    for hf_cfg in configs:
        qc = _quant_config(target, hf_cfg)
        for dtype in _dtypes(device):
            reasons = qc.validate(dtype, device)
            if reasons:
                rejected.append(f"{hf_cfg} {dtype}: {'; '.join(reasons)}")
                continue
            for prefix, k, outs in LAYERS:
                for bias in (False, True):
                    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
                    with torch.device(device):  # gate|up and q|k|v as the models build them (a method may
                        # fuse SwiGLU, or lay q|k rows out for a fused rotation: rope_heads, as Llama sets it)
                        if prefix.endswith("gate_up_proj"):
                            layer = MergedColumnParallelLinear(k, outs, bias, qc, prefix, dtype, parallel=False)
                        elif prefix.endswith("qkv_proj"):
                            hd = outs[1]
                            layer = QKVParallelLinear(k, hd, outs[0] // hd, 1, bias, qc, prefix, dtype, parallel=False)
                            layer.rope_heads = outs[0] // hd + 1
                        else:
                            layer = FusedLinear(k, outs, bias, qc, prefix, dtype)
                    method = layer.method
                    make = getattr(method, "make_test_weights", None)
                    deq = getattr(method, "dequantize_test_weights", None)
                    dense = None
                    if make is None or deq is None:
                        dense = _dense_protocol(layer, k, outs)
                        if dense is None:
                            _no_protocol(target, method, layer)
                        make, deq = dense
                    tensors = make(k, list(outs), dtype, gen)
                    for name, shards in tensors.items():
                        if len(shards) != len(outs):
                            raise AssertionError(f"{target}: make_test_weights gave {len(shards)} shards for "
                                                 f"{name!r}, expected {len(outs)}")
                        for i, t in enumerate(shards):
                            layer.load(name, t.to(device), i if len(outs) > 1 else None)
                    b = None
                    if bias:
                        b = torch.randn(sum(outs), generator=gen).to(dtype)
                        layer.load("bias", b.to(device), None)
                    method.process_weights_after_loading(layer)
                    if dense is not None and _dense_protocol(layer, k, outs) is None:
                        _no_protocol(target, method, layer)  # e.g. quantized online after loading
                    w_ref = deq(tensors, k, list(outs)).float().cpu()
                    if tuple(w_ref.shape) != (sum(outs), k):
                        raise AssertionError(f"{target}: dequantize_test_weights returned shape {tuple(w_ref.shape)}, "
                                             f"expected {(sum(outs), k)}")
                    rtol = getattr(method, "test_rtol", None)
                    dname = str(dtype).removeprefix("torch.")
                    if isinstance(rtol, dict):
                        rtol = rtol.get(dname)
                    rtol = rtol if rtol is not None else DEFAULT_RTOL[dname]
                    for t in NUM_TOKENS:
                        x = torch.randn(t, k, generator=gen).to(dtype)
                        with torch.inference_mode():
                            y = layer(x.to(device))
                        ref = x.float() @ w_ref.T + (b.float() if b is not None else 0)
                        where = (f"{tag}: {prefix} K={k} outputs={outs} bias={bias} {dname} T={t} "
                                 f"quantization_config={hf_cfg}")
                        if tuple(y.shape) != (t, sum(outs)) or y.dtype != dtype:
                            raise AssertionError(f"{where}: apply returned {tuple(y.shape)} {y.dtype}, expected "
                                                 f"{(t, sum(outs))} {dtype}")
                        y = y.float().cpu()
                        if not torch.isfinite(y).all():
                            raise AssertionError(f"{where}: non-finite output")
                        err = ((y - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
                        if err > rtol:
                            raise AssertionError(f"{where}: max|y - x W_deq^T| / max|ref| = {err:.3g} > {rtol}")
                        if layer.gate_up:
                            _check_silu_and_mul(layer, x.to(device), ref, outs, rtol, where)
                        _check_prenorm(layer, x, w_ref, b, outs, rtol, where, gen, device)
                    ran += 1
    if ran == 0:
        raise AssertionError(f"{target}: validate() rejected every dtype on {device}:\n  " + "\n  ".join(rejected))
    print(f"{target}: {ran} layers checked, {len(rejected)} (config, dtype) pairs rejected by validate()")


def _check_silu_and_mul(layer, x, ref, outs, rtol: float, where: str) -> None:
    """A gate|up layer's ``silu_and_mul`` (the method's ``apply_silu_and_mul`` where it has
    one) against silu(gate) * up of the float32 reference. The activation roughly doubles the
    relative error of its inputs, so the bound is 4 x rtol."""
    import torch
    import torch.nn.functional as F
    with torch.inference_mode():
        act = layer.silu_and_mul(x)
    gate, up = ref.split(list(outs), dim=-1)
    want = F.silu(gate) * up
    if tuple(act.shape) != tuple(want.shape) or act.dtype != x.dtype:
        raise AssertionError(f"{where}: silu_and_mul returned {tuple(act.shape)} {act.dtype}, expected "
                             f"{tuple(want.shape)} {x.dtype}")
    err = ((act.float().cpu() - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
    if err > 4 * rtol:
        raise AssertionError(f"{where}: max|silu_and_mul - silu(gate) * up| / max|ref| = {err:.3g} > {4 * rtol}")


def _check_prenorm(layer, x, w_ref, b, outs, rtol: float, where: str, gen, device) -> None:
    """``forward_prenorm(x, residual, norm)`` (the method's ``apply_add_rmsnorm`` where it has
    one, else the norm then ``apply``) against the float32 reference of RMSNorm(x + residual)
    (torch path, rounded to x's dtype as the model's norm output); the new residual must be
    x + residual exactly. A gate|up layer also with ``silu_and_mul`` (bound 4 x rtol); a q|k|v
    layer with ``rope`` (its q and k heads rotated, as ``kvforge.layers.rotary``)."""
    import torch
    import torch.nn.functional as F

    from kvforge.layers.layernorm import RMSNorm
    k = x.shape[1]
    norm = RMSNorm(k, 1e-5, x.dtype)
    norm.weight.data.copy_((1 + 0.2 * torch.randn(k, generator=gen)).to(x.dtype))
    res = torch.randn(x.shape, generator=gen).to(x.dtype)
    r_ref = x + res
    ref = norm._norm(r_ref).float() @ w_ref.T + (b.float() if b is not None else 0)
    norm = norm.to(device)
    rope = None
    if hasattr(layer, "head_dim"):  # q|k|v: also the rotation (RoPE, theta 10000, random positions)
        from types import SimpleNamespace

        from kvforge.layers.rotary import RotaryEmbedding
        rotary = RotaryEmbedding(SimpleNamespace(rope_theta=10000.0), layer.head_dim, 64)
        positions = torch.randint(0, 64, (x.shape[0],), generator=gen)
        rope = (positions.to(device), rotary.to(device))
        t, hd, nq = x.shape[0], layer.head_dim, outs[0]
        q, kk = ref[:, :nq].view(t, -1, hd), ref[:, nq:nq + outs[1]].view(t, -1, hd)
        cos, sin = rotary.cos.cpu()[positions], rotary.sin.cpu()[positions]
        ref = torch.cat([rotary._rotate(q, cos, sin).reshape(t, -1), rotary._rotate(kk, cos, sin).reshape(t, -1),
                         ref[:, nq + outs[1]:]], 1)
    for act in ((False, True) if layer.gate_up else (False,)):
        with torch.inference_mode():
            y, r = (layer.forward_prenorm(x.to(device), res.to(device), norm, silu_and_mul=act) if rope is None
                    else layer.forward_prenorm(x.to(device), res.to(device), norm, rope=rope))
        want = F.silu(ref.split(list(outs), dim=-1)[0]) * ref.split(list(outs), dim=-1)[1] if act else ref
        what = "forward_prenorm" + (" (silu_and_mul)" if act else " (rope)" if rope is not None else "")
        if not torch.equal(r.cpu(), r_ref):
            raise AssertionError(f"{where}: {what} returned a residual other than x + residual")
        if tuple(y.shape) != tuple(want.shape) or y.dtype != x.dtype:
            raise AssertionError(f"{where}: {what} returned {tuple(y.shape)} {y.dtype}, expected "
                                 f"{tuple(want.shape)} {x.dtype}")
        err = ((y.float().cpu() - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
        bound = (4 if act else 1) * rtol
        if err > bound:
            raise AssertionError(f"{where}: max|{what} - reference| / max|ref| = {err:.3g} > {bound}")


def check_engine_smoke(target: Target) -> None:
    """The quantizer serves the test model end to end (greedy requests finish, blocks drain);
    skipped if it cannot load that (unquantized) checkpoint."""
    import pytest
    from kvforge import SamplingParams
    try:
        eng = target.engine(quantization=target.name, **{"quantization.settings": dict(target.settings)})
    except ValueError as e:
        pytest.skip(f"{target} cannot serve the test model {target.model}: {e}")
    sp = SamplingParams(temperature=0.0, max_tokens=12)
    for i, p in enumerate(("Once upon a time", "The cat", "Lily went to the")):
        eng.add_request(f"q{i}", p, sp)
    done: dict[str, Any] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    bad = {k: (o.outputs[0].finish_reason, o.error) for k, o in done.items()
           if o.outputs[0].finish_reason not in ("stop", "length")}
    if bad or len(done) != 3:
        raise AssertionError(f"{target}: engine requests failed: {bad}")
    assert_drained(eng, str(target))


CHECKS = [check_linear_matches_dequantized_reference, check_engine_smoke]
