"""``int4_layout`` setting of the ``awq`` / ``gptq`` quantizers (``WeightOnlySettings``).

On the Triton path (``backend: triton``; on CPU through the Triton interpreter) a 4-bit
weight of an fp16/bf16 layer whose group size is a multiple of 64 is repacked at load time
into the pairs layout (``kernels/w4_pairs.py``: ``qweight`` int32 [K/8, N],
``layer.wna16_tile_k`` set); ``checkpoint`` keeps the checkpoint's packing, ``auto`` falls
back to it when the layout does not apply and ``pairs`` refuses such a layer.

Each layer is built as the model loader does (``FusedLinear`` + the quantizer's config,
checkpoint tensors loaded shard by shard through the parameters' own loaders, then
``process_weights_after_loading``), and its output is compared with ``x @ W_ref`` where
``W_ref = (q - z) * s`` is computed in fp32 from the random integers the checkpoint tensors
were packed from (not from anything the layer holds, so a repacking bug shows). Weights and
activations are fresh random data each run; the seed is in every failure message.
Bound: ``max|y - ref| / max|ref| <= 2e-3`` for fp16 activations (as ``wna16_cases.py``).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from kvforge.layers.linear import FusedLinear  # noqa: E402
from kvforge_plugins.quant.awq import AWQConfig, AWQSettings  # noqa: E402
from kvforge_plugins.quant.gptq import GPTQConfig, GPTQSettings  # noqa: E402
from kvforge_plugins.quant.kernels.wna16 import dequantize_wna16  # noqa: E402

BOUND = 2e-3
N_KERNEL_TESTS = 7  # the @kernel_test cases below (with parametrizations)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AutoAWQ word holds column 8c + AWQ_ORDER[i]


# Triton's own library functions (``tl.cdiv``, ...) are jitted when Triton is imported, so
# switching ``TRITON_INTERPRET`` on later in this process (monkeypatch) makes the kernels fail
# with "Cannot call @triton.jit'd outside of the scope of a kernel". On a CPU host the kernel
# tests therefore run in a child pytest with the variable set from the start (as
# test_fused_kernels.py does); setting it here would leak into every other test module.
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
kernel_test = pytest.mark.skipif(
    torch.cuda.is_available() or not INTERPRETING,
    reason="runs inside test_int4_layout_under_triton_interpreter (CPU hosts only)")


@pytest.mark.skipif(torch.cuda.is_available() or INTERPRETING, reason="CPU host driver of the interpreter run")
def test_int4_layout_under_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    me = os.path.abspath(__file__)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", me,
                           "-k", "not test_int4_layout_under_triton_interpreter"],
                          env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout.strip().splitlines()
    last = out[-1] if out else ""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    # every case ran there: nothing skipped, only this driver deselected
    m = re.fullmatch(r"(\d+) passed, 1 deselected in [\d.]+s( \([\d:]+\))?", last)
    assert m and int(m.group(1)) >= N_KERNEL_TESTS, proc.stdout[-2000:]


@pytest.fixture
def gen():
    seed = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
    return torch.Generator().manual_seed(seed)  # gen.initial_seed() is reported on failure


# ---------------------------------------------------------------------------------------------
# Checkpoint tensors, packed by hand (independently of the plugin's pack helpers)
# ---------------------------------------------------------------------------------------------

def _pack_n(v: torch.Tensor, awq: bool) -> torch.Tensor:
    """[R, C] ints in [0, 16) -> int32 [R, C/8] packed along columns (AutoAWQ or plain order)."""
    r, c = v.shape
    words = torch.zeros(r, c // 8, dtype=torch.int64)
    for i in range(8):
        col = AWQ_ORDER[i] if awq else i
        words |= v[:, col::8].to(torch.int64) << (4 * i)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # as two's-complement int32


def _pack_k(v: torch.Tensor) -> torch.Tensor:
    """[K, N] ints in [0, 16) -> int32 [K/8, N] packed along rows (GPTQ: row 8r + i in field i)."""
    return _pack_n(v.t().contiguous(), awq=False).t().contiguous()


def _random_quant(k: int, n: int, group: int, gen: torch.Generator, zlo: int = 0):
    """q [K, N], z [G, N] (in [zlo, 16)), s fp16 [G, N], W_ref^T fp32 [K, N] = (q - z[g]) * s[g]."""
    groups = k // group
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    z = torch.randint(zlo, 16, (groups, n), generator=gen, dtype=torch.int32)
    s = ((torch.rand(groups, n, generator=gen) + 0.5) * (2.0 / 16) * k ** -0.5).half()
    g = torch.arange(k) // group
    w_ref = (q - z[g]).float() * s.float()[g]
    return q, z, s, w_ref


def _awq_layer(dtype, group: int, layout: str, gen, k: int = 128, n: int = 64,
               prefix: str = "model.layers.0.self_attn.o_proj", backend: str = "triton"):
    """An ``awq`` FusedLinear (one projection) loaded from random AutoAWQ tensors; returns
    (layer, W_ref^T fp32 [K, N], the checkpoint qweight)."""
    qc = AWQConfig({"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"},
                   AWQSettings(backend=backend, int4_layout=layout))
    q, z, s, w_ref = _random_quant(k, n, group, gen)
    qweight, qzeros = _pack_n(q, awq=True), _pack_n(z, awq=True)
    # the hand packing agrees with the kernels' own reader of the AutoAWQ format
    deq = dequantize_wna16(qweight, s, z.to(torch.uint8), bits=4, group_size=group, pack_k=False, awq_order=True,
                           dtype=torch.float32)
    assert torch.equal(deq, w_ref), "test bug: AWQ hand packing disagrees with dequantize_wna16"
    layer = FusedLinear(k, [n], False, qc, prefix, dtype)
    layer.load("qweight", qweight.clone(), None)
    layer.load("qzeros", qzeros, None)
    layer.load("scales", s, None)
    return layer, w_ref, qweight


def _check_output(layer, w_ref, gen, dtype, where: str, bias=None, tokens=(1, 3)):
    for t in tokens:
        x = torch.randn(t, w_ref.shape[0], generator=gen).to(dtype)
        with torch.inference_mode():
            y = layer(x)
        assert y.shape == (t, w_ref.shape[1]) and y.dtype == dtype, (where, y.shape, y.dtype)
        ref = x.float() @ w_ref + (bias.float() if bias is not None else 0)
        y = y.float()
        assert torch.isfinite(y).all(), f"{where} T={t}: non-finite output"
        err = ((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        assert err <= BOUND, f"{where} T={t}: max|y - x W_ref| / max|ref| = {err:.3g} > {BOUND}"


@kernel_test
# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["auto", "pairs"])
def test_awq_g64_fp16_repacked_to_pairs(gen, layout):
    """fp16, AWQ group 64, K 128: ``auto`` (and ``pairs``) repack (tile_k 64, qweight [K/8, N])
    and the pairs kernel computes x @ W_ref."""
    k, n = 128, 64
    where = f"awq g64 fp16 int4_layout={layout} (seed {gen.initial_seed()})"
    layer, w_ref, qweight = _awq_layer(torch.float16, 64, layout, gen, k, n)
    layer.method.process_weights_after_loading(layer)
    assert layer.wna16_kernel, where
    assert layer.wna16_tile_k == 64, f"{where}: wna16_tile_k {layer.wna16_tile_k}"
    assert tuple(layer.qweight.shape) == (k // 8, n), f"{where}: qweight {tuple(layer.qweight.shape)}"
    assert layer.qweight.dtype == torch.int32
    assert not torch.equal(layer.qweight.reshape(-1).sort().values, qweight.reshape(-1).sort().values), \
        f"{where}: the weight words were not repacked"
    # the reference path reads the repacked layout back exactly
    assert torch.equal(layer.method.dequantized(layer, torch.float32), w_ref), f"{where}: dequantized() != W_ref"
    _check_output(layer, w_ref, gen, torch.float16, where)


@kernel_test
def test_awq_g64_fp16_checkpoint_layout_keeps_packing(gen):
    """``checkpoint``: no repack (tile_k None, qweight keeps AutoAWQ's [K, N/8] words bit for
    bit); the wna16 kernel computes x @ W_ref."""
    k, n = 128, 64
    where = f"awq g64 fp16 int4_layout=checkpoint (seed {gen.initial_seed()})"
    layer, w_ref, qweight = _awq_layer(torch.float16, 64, "checkpoint", gen, k, n)
    layer.method.process_weights_after_loading(layer)
    assert layer.wna16_kernel, where
    assert not layer.wna16_tile_k, f"{where}: wna16_tile_k {layer.wna16_tile_k}"
    assert tuple(layer.qweight.shape) == (k, n // 8), f"{where}: qweight {tuple(layer.qweight.shape)}"
    assert torch.equal(layer.qweight, qweight), f"{where}: checkpoint words changed"
    _check_output(layer, w_ref, gen, torch.float16, where)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dtype, group, prefix", [(torch.float32, 64, "model.layers.3.mlp.down_proj"),
                                                   (torch.float16, 32, "model.layers.1.self_attn.o_proj")],
                         ids=["float32", "group32"])
def test_pairs_refuses_what_it_cannot_hold(gen, dtype, group, prefix, backend):
    """``pairs`` on a float32 layer, or with group 32 (tiles of 64 do not fit in a group):
    ValueError naming the layer and int4_layout, on the reference backend too."""
    layer, _, _ = _awq_layer(dtype, group, "pairs", gen, prefix=prefix, backend=backend)
    with pytest.raises(ValueError) as e:
        layer.method.process_weights_after_loading(layer)
    msg = str(e.value)
    assert prefix in msg and "int4_layout" in msg, msg


@pytest.mark.parametrize("what", ["gptq_v1_zero_16", "fp32_scales"])
def test_mma_refuses_what_it_cannot_hold(gen, what):
    """``mma`` stores 4-bit zero points and fp16 scales: a GPTQ v1 zero point of 16 (a stored
    15, plus 1) or checkpoint scales that fp16 would change are refused with a ValueError naming
    the layer, int4_layout and the cause, on the reference backend too (nothing is rounded)."""
    k, n, group = 128, 64, 64
    prefix = "model.layers.2.mlp.down_proj"
    if what == "gptq_v1_zero_16":
        qc = GPTQConfig({"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": False},
                        GPTQSettings(backend="reference", int4_layout="mma"))
        q, z, s, _ = _random_quant(k, n, group, gen, zlo=1)  # v1 stores z - 1 >= 0
        z[1, 5] = 16
        layer = FusedLinear(k, [n], False, qc, prefix, torch.float16)
        layer.load("qweight", _pack_k(q), 0)
        layer.load("qzeros", _pack_n((z - 1).contiguous(), awq=False), 0)
        layer.load("scales", s, 0)
        layer.load("g_idx", (torch.arange(k) // group).to(torch.int32), 0)
        cause = "zero points are not all 4-bit"
    else:
        layer, _, _ = _awq_layer(torch.float16, group, "mma", gen, k, n, prefix=prefix, backend="reference")
        layer.load("scales", torch.rand(k // group, n, generator=gen) * 0.01 + 1e-3, None)  # fp32, not fp16 values
        cause = "not all exact in float16"
    with pytest.raises(ValueError) as e:
        layer.method.process_weights_after_loading(layer)
    msg = str(e.value)
    assert prefix in msg and "int4_layout 'mma'" in msg and cause in msg, msg


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_auto_falls_back_to_checkpoint_packing(gen, dtype):
    """``auto`` where pairs does not apply (fp16 group 32; float32 group 64): no repack, no
    error, output still x @ W_ref (fp32: wna16 kernel, bound 1e-5 there would also hold; 2e-3 used)."""
    group = 32 if dtype == torch.float16 else 64
    k, n = 128, 64
    where = f"awq g{group} {dtype} int4_layout=auto (seed {gen.initial_seed()})"
    layer, w_ref, qweight = _awq_layer(dtype, group, "auto", gen, k, n)
    layer.method.process_weights_after_loading(layer)
    assert layer.wna16_kernel, where
    assert layer.wna16_tile_k is None, f"{where}: wna16_tile_k {layer.wna16_tile_k}"
    assert tuple(layer.qweight.shape) == (k, n // 8), f"{where}: qweight {tuple(layer.qweight.shape)}"
    assert torch.equal(layer.qweight, qweight), f"{where}: checkpoint words changed"
    _check_output(layer, w_ref, gen, dtype, where)


@kernel_test
@pytest.mark.parametrize("layout", ["auto", "checkpoint"])
def test_gptq_g128_fp16(gen, layout):
    """GPTQ 4-bit (v1 zeros: stored z - 1), group 128, K 256, fused gate|up with bias, fp16:
    ``auto`` repacks (tile_k 128, qweight [K/8, N] in the pairs layout), ``checkpoint`` keeps
    GPTQ's [K/8, N] words; both compute x @ W_ref + b."""
    k, outs, group = 256, [32, 32], 128
    n = sum(outs)
    where = f"gptq g128 fp16 int4_layout={layout} (seed {gen.initial_seed()})"
    qc = GPTQConfig({"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": False},
                    GPTQSettings(backend="triton", int4_layout=layout))
    q, z, s, w_ref = _random_quant(k, n, group, gen, zlo=1)  # v1 stores z - 1 >= 0
    layer = FusedLinear(k, outs, True, qc, "model.layers.0.mlp.gate_up_proj", torch.float16)
    g_idx = (torch.arange(k) // group).to(torch.int32)
    lo = 0
    packed = []
    for i, o in enumerate(outs):
        cols = slice(lo, lo + o)
        qw = _pack_k(q[:, cols].contiguous())
        packed.append(qw)
        layer.load("qweight", qw, i)
        layer.load("qzeros", _pack_n((z[:, cols] - 1).contiguous(), awq=False), i)
        layer.load("scales", s[:, cols].contiguous(), i)
        layer.load("g_idx", g_idx, i)
        lo += o
    qweight = torch.cat(packed, 1)
    deq = dequantize_wna16(qweight, s, z.to(torch.uint8), bits=4, group_size=group, pack_k=True, awq_order=False,
                           dtype=torch.float32)
    assert torch.equal(deq, w_ref), "test bug: GPTQ hand packing disagrees with dequantize_wna16"
    bias = torch.randn(n, generator=gen).half()
    layer.load("bias", bias, None)
    layer.method.process_weights_after_loading(layer)
    assert layer.wna16_kernel, where
    assert tuple(layer.qweight.shape) == (k // 8, n), f"{where}: qweight {tuple(layer.qweight.shape)}"
    if layout == "auto":
        assert layer.wna16_tile_k == 128, f"{where}: wna16_tile_k {layer.wna16_tile_k}"
        assert not torch.equal(layer.qweight, qweight), f"{where}: the weight words were not repacked"
    else:
        assert not layer.wna16_tile_k, f"{where}: wna16_tile_k {layer.wna16_tile_k}"
        assert torch.equal(layer.qweight, qweight), f"{where}: checkpoint words changed"
    assert torch.equal(layer.method.dequantized(layer, torch.float32), w_ref), f"{where}: dequantized() != W_ref"
    _check_output(layer, w_ref, gen, torch.float16, where, bias=bias)


@pytest.mark.parametrize("cls", [AWQSettings, GPTQSettings])
def test_int4_layout_validation(cls):
    from pydantic import ValidationError
    for ok in ("auto", "pairs", "checkpoint"):
        assert cls(int4_layout=ok).int4_layout == ok
    assert cls().int4_layout == "auto"
    with pytest.raises(ValidationError) as e:
        cls(int4_layout="bogus")
    assert "int4_layout" in str(e.value), str(e.value)


@pytest.mark.parametrize("cls", [AWQSettings, GPTQSettings])
def test_fuse_norm_max_tokens_validation(cls):
    from pydantic import ValidationError

    from kvforge_plugins.quant.kernels import w4_mma
    from kvforge_plugins.quant.weight_only import WNA16LinearMethod
    assert cls().fuse_norm_max_tokens == 2
    for ok in (1, w4_mma.MAX_NORM_M):
        assert cls(fuse_norm_max_tokens=ok).fuse_norm_max_tokens == ok
    for bad in (0, w4_mma.MAX_NORM_M + 1, "two"):
        with pytest.raises(ValidationError, match="fuse_norm_max_tokens"):
            cls(fuse_norm_max_tokens=bad)
    for bad in (0, 9, 2.5, True):  # the method checks too (another caller than the settings)
        with pytest.raises(ValueError, match="fuse_norm_max_tokens must be an int in 1..8"):
            WNA16LinearMethod("awq", 4, 64, 0, "reference", "", fuse_norm_max_tokens=bad)


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_fuse_norm_max_tokens_reaches_the_method(fmt):
    if fmt == "awq":
        qc = AWQConfig({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"},
                       AWQSettings(fuse_norm_max_tokens=5))
    else:
        qc = GPTQConfig({"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": False},
                        GPTQSettings(fuse_norm_max_tokens=5))
    assert qc.get_linear_method("model.layers.0.mlp.gate_up_proj").fuse_norm_max_tokens == 5


def test_repack_of_a_wide_layer_in_column_chunks(gen):
    """A layer wider than the repack's 4096-column chunks (N = 4104: two chunks, the last
    one 8 columns): the pairs words read back exactly the checkpoint's weight (no kernel
    runs: ``dequantized`` unpacks the pairs layout in torch)."""
    layer, w_ref, _ = _awq_layer(torch.float16, 64, "auto", gen, k=128, n=4104)
    layer.method.process_weights_after_loading(layer)
    assert layer.wna16_tile_k == 64 and tuple(layer.qweight.shape) == (16, 4104)
    assert torch.equal(layer.method.dequantized(layer, torch.float32), w_ref)
