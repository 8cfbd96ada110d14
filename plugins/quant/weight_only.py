"""Weight-only int4/int8 linear method shared by the ``awq`` and ``gptq`` quantizers.

Checkpoint parameters of one (possibly fused) layer, K = input_size, N = sum(output_sizes),
pf = 32 // bits, G = ceil(K / group_size) (1 for per-channel):

============  =========================  ==========================================
tensor        AutoAWQ GEMM (``awq``)      GPTQ (``gptq``)
============  =========================  ==========================================
qweight       int32 [K, N/8], packed      int32 [K/pf, N], packed along K
              along N in AWQ order
qzeros        int32 [G, N/8], AWQ order   int32 [G, N/pf], packed along N (plain
                                          order); v1 format stores ``zero - 1``
scales        fp16 [G, N]                 fp16 [G, N]
g_idx         --                          int32 [K]: group of input row k (act-order)
============  =========================  ==========================================

Shards of a fused layer (q|k|v, gate|up) are concatenated along N. After loading, zero
points are unpacked to ``wzeros`` uint8 [G, N] (true zero points) and, on the GPU
kernel path, act-order rows are permuted so groups are contiguous (``perm`` [K]; the
activation is gathered with it), and 4-bit weights are repacked into the pairs layout
(``kernels/w4_pairs.py``; ``layer.wna16_tile_k`` set) or, with ``int4_layout: mma``, the mma
layout (``kernels/w4_mma.py``; ``mma_scales`` (fp16) replaces ``scales``, ``wzeros`` holds the
zero points as 4-bit fields of int32 words; a gate|up pair, ``layer.gate_up``, with its rows
interleaved 8 by 8 so the kernel writes silu(gate) * up itself: ``apply_silu_and_mul``,
``layer.wna16_gated``);
``layer.wna16_layout`` names the layout.
Dequantized weight: ``W^T[k, n] = (q[k, n] - wzeros[g(k), n]) * scales[g(k), n]``.
"""
from __future__ import annotations

import logging

import torch

from kvforge.interfaces import LinearMethod

from .act_order import apply_act_order
from .common import FLOAT_DTYPES, FUSE_NORM_MAX_TOKENS, add_param, unpack_cols, unpack_rows
from .kernels import HAS_TRITON
from .kernels import w4_mma
from .kernels.w4_pairs import DTYPES as PAIRS_DTYPES
from .kernels.w4_pairs import dequantize_pairs, pack_pairs, pairs_gemm, pairs_tile_k
from .kernels.wna16 import dequantize_wna16, wna16_gemm

log = logging.getLogger("kvforge.quant")


class WNA16LinearMethod(LinearMethod):
    """Weight-only quantized linear layer (see module docstring for tensors).

    Args:
        fmt: ``"awq"``, ``"gptq"`` or ``"ct"`` (compressed-tensors pack-quantized) checkpoint layout.
        bits: 4 (AWQ, GPTQ) or 8 (GPTQ).
        group_size: rows of K sharing a scale; -1 = one group (per-channel).
        zero_offset: added to stored zero points (1 for GPTQ v1 checkpoints, else 0).
        backend: ``auto`` (Triton on CUDA, reference elsewhere), ``triton``, ``reference``.
        skip_hint: how this format's config keeps a layer unquantized (for error messages).
        desc_act: GPTQ act-order. A non-trivial ``g_idx`` is honoured either way (``act_order.py``
            says why), except on a row-parallel split: there True keeps every group's scales and
            zero points on each rank (``layer.wna16_all_groups``), False splits them by group and
            tolerates only a rank's slice of the trivial g_idx.
        symmetric: compressed-tensors only: no zero-point tensor (zero point 2**(bits-1)).
        int4_layout: ``auto``, ``mma``, ``pairs`` or ``checkpoint`` (``common.WeightOnlySettings``).
        fuse_norm: fold a pre-norm into the mma GEMM (:meth:`apply_add_rmsnorm`) at steps of at most
            ``fuse_norm_max_tokens`` tokens (1..``w4_mma.MAX_NORM_M``; ValueError otherwise).
    """

    def __init__(self, fmt: str, bits: int, group_size: int, zero_offset: int, backend: str,
                 skip_hint: str, desc_act: bool = False, symmetric: bool = False, int4_layout: str = "auto",
                 fuse_norm: bool = True, fuse_norm_max_tokens: int = FUSE_NORM_MAX_TOKENS) -> None:
        assert fmt in ("awq", "gptq", "ct")
        self.fmt, self.bits, self.group_size, self.zero_offset = fmt, bits, group_size, zero_offset
        self.desc_act = desc_act
        self.symmetric = symmetric
        self.backend = backend
        self.pf = 32 // bits
        self.skip_hint = skip_hint
        self.int4_layout = int4_layout
        if not (type(fuse_norm_max_tokens) is int and 1 <= fuse_norm_max_tokens <= w4_mma.MAX_NORM_M):
            raise ValueError(f"fuse_norm_max_tokens must be an int in 1..{w4_mma.MAX_NORM_M} (the fused kernel's "
                             f"token block), got {fuse_norm_max_tokens!r}")
        self.fuse_norm = fuse_norm
        self.fuse_norm_max_tokens = fuse_norm_max_tokens
        self._told_reference = False
        self._told_g_idx = False

    # -- loading ---------------------------------------------------------------------------
    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        k, n, pf = input_size, sum(output_sizes), self.pf
        gs = k if self.group_size == -1 else self.group_size
        where = f"{layer.prefix} (in {k}, out {output_sizes})"
        bad = []
        if any(o % pf for o in output_sizes):
            bad.append(f"out features must be multiples of {pf} (the {self.bits}-bit packing along N)")
        if self.fmt != "awq" and k % pf:
            bad.append(f"in features must be a multiple of {pf} (the {self.bits}-bit packing along K)")
        if self.fmt == "awq" and k % gs:
            bad.append(f"in features must be a multiple of group_size {gs}")
        if bad:
            raise ValueError(f"{self.fmt}: layer {where} cannot be stored in this format: {'; '.join(bad)}. "
                             f"A real checkpoint keeps such layers unquantized ({self.skip_hint})")
        groups = -(-k // gs)
        # Row-parallel split (RowParallelLinear: k = this rank's rows of global_input_size):
        # with one group (-1) or GPTQ act-order a rank's rows belong to groups of every rank,
        # so scales and zero points stay whole on each rank (as in vLLM) and g_idx keeps global
        # group numbers; act_order.py trims them back to the rank's own groups where it can.
        # Other layers keep their groups' share (proportional slicing along ``input_dim``).
        k_all = getattr(layer, "global_input_size", k)
        all_groups = k_all != k and (self.group_size == -1 or (self.fmt == "gptq" and self.desc_act))
        if all_groups and self.group_size != -1:  # (-1: gs is the local k; the one group stays one)
            groups = -(-k_all // gs)
        g_dim = None if all_groups else 0
        layer.wna16_all_groups = all_groups
        layer.wna16_k, layer.wna16_n, layer.wna16_group = k, n, gs
        layer.wna16_dtype = params_dtype
        packed_n = [o // pf for o in output_sizes]
        ints = (torch.int32,)
        if self.fmt == "ct":
            self._create_ct(layer, k, output_sizes, groups, None if all_groups else 1)
            return
        if self.fmt == "awq":
            add_param(layer, "qweight", (k, n // pf), torch.int32, dim=1, shard_sizes=packed_n, allowed=ints,
                      packed_factor=pf, what="AWQ int32 [in, out/8]", input_dim=0)
        else:
            add_param(layer, "qweight", (k // pf, n), torch.int32, dim=1, shard_sizes=output_sizes, allowed=ints,
                      what=f"GPTQ int32 [in/{pf}, out]", input_dim=0)
            gi = add_param(layer, "g_idx", (len(output_sizes), k), torch.int32, dim=None, shard_sizes=output_sizes,
                           allowed=(torch.int32, torch.int64), what="GPTQ int32 [in]", input_dim=0)
            row0 = getattr(layer, "tp_rank", 0) * k if all_groups else 0  # global rows: the default is global too
            gi.data.copy_((torch.arange(row0, row0 + k) // gs).expand(len(output_sizes), k))
        add_param(layer, "qzeros", (groups, n // pf), torch.int32, dim=1, shard_sizes=packed_n, allowed=ints,
                  packed_factor=pf, what=f"int32 [groups={groups}, out/{pf}]", input_dim=g_dim)
        # finite only: a zero scale (an all-zero group) is harmless, and some exporters write
        # negative symmetric scales (q - z) * s with s < 0; neither is divided by
        add_param(layer, "scales", (groups, n), torch.float32, dim=1, shard_sizes=output_sizes,
                  allowed=FLOAT_DTYPES, what=f"float [groups={groups}, out]", input_dim=g_dim, scale_values="finite")

    def _create_ct(self, layer, k, output_sizes, groups, g_dim):
        """compressed-tensors pack-quantized: ``weight_packed`` int32 [N, K/pf] (packed along K,
        plain order: the transpose of GPTQ's qweight), ``weight_scale`` [N, G], asymmetric
        ``weight_zero_point`` int32 [N/pf, G] (packed along N), ``weight_shape`` int [2] = (N_i, K).
        Stored values are offset by 2**(bits-1) (signed -> unsigned), zero points too. ``g_dim``:
        the ``input_dim`` of scales and zero points (None: whole on every rank)."""
        pf, n = self.pf, sum(output_sizes)
        add_param(layer, "weight_packed", (n, k // pf), torch.int32, dim=0, shard_sizes=output_sizes,
                  allowed=(torch.int32,), packed_factor=pf, what=f"int32 [out, in/{pf}]", input_dim=1)
        add_param(layer, "weight_scale", (n, groups), torch.float32, dim=0, shard_sizes=output_sizes,
                  allowed=FLOAT_DTYPES, what=f"float [out, groups={groups}]", input_dim=g_dim, scale_values="finite")
        if not self.symmetric:
            add_param(layer, "weight_zero_point", (n // pf, groups), torch.int32, dim=0,
                      shard_sizes=[o // pf for o in output_sizes], allowed=(torch.int32,), packed_factor=pf,
                      what=f"int32 [out/{pf}, groups={groups}]", input_dim=g_dim)
        ws = add_param(layer, "weight_shape", (len(output_sizes), 2), torch.int64, dim=None, shard_sizes=output_sizes,
                       allowed=(torch.int64, torch.int32), what="int [2] = (out, in)")
        ws.expected = torch.tensor([[o, k] for o in output_sizes], device="cpu")  # (not a default device's)
        ws.data.copy_(ws.expected)

    def _canonical_ct(self, layer):
        """compressed-tensors tensors -> the GPTQ layout (qweight [K/pf, N], scales/qzeros [G, N])."""
        got, want = layer.weight_shape.data.cpu(), layer.weight_shape.expected
        if (got < want).any() or (got % want).any():  # a multiple: the unsliced shape under tensor parallelism
            raise ValueError(f"{layer.prefix}.weight_shape: checkpoint says {layer.weight_shape.data.tolist()}, "
                             f"the model needs {layer.weight_shape.expected.tolist()} (out, in)")
        layer.qweight = torch.nn.Parameter(layer.weight_packed.data.t().contiguous(), requires_grad=False)
        layer.scales = torch.nn.Parameter(layer.weight_scale.data.t().contiguous(), requires_grad=False)
        if self.symmetric:
            zeros = torch.full_like(layer.scales.data, 2 ** (self.bits - 1), dtype=torch.int32)
        else:
            zeros = unpack_rows(layer.weight_zero_point.data, self.bits).t()
            del layer.weight_zero_point
        del layer.weight_packed, layer.weight_scale, layer.weight_shape
        return zeros

    def process_weights_after_loading(self, layer):
        if self.fmt == "ct":
            zeros = self._canonical_ct(layer)
        else:
            zeros = unpack_cols(layer.qzeros.data, self.bits, awq_order=self.fmt == "awq") + self.zero_offset
            del layer.qzeros
        if int(zeros.max()) > 255:
            raise ValueError(f"{layer.prefix}.qzeros: zero point out of range")
        layer.register_buffer("wzeros", zeros.to(torch.uint8).contiguous(), persistent=False)
        s = layer.scales.data
        s16 = s.half()
        dummy = not getattr(layer.scales, "loaded_shards", True)  # load_format=dummy: benchmark like fp16
        if dummy or torch.equal(s16.float(), s):  # fp16 checkpoint scales: keep them exactly, half the bytes
            layer.scales = torch.nn.Parameter(s16, requires_grad=False)
        layer.register_buffer("g_idx_ref", None, persistent=False)
        layer.register_buffer("perm", None, persistent=False)
        device = layer.qweight.device
        layer.wna16_kernel = HAS_TRITON and (self.backend == "triton" or
                                             (self.backend == "auto" and device.type == "cuda"))
        layer.wna16_tile_k = None  # set when the weight is repacked into the pairs layout
        layer.wna16_layout = "checkpoint"
        layer.wna16_gated = False  # set when a gate|up pair is repacked interleaved (mma layout)
        layer.wna16_rope = None  # (heads, head_dim) when q|k rows are repacked in the rotary layout (mma)
        against_config = apply_act_order(layer, self.desc_act, self.bits) if self.fmt == "gptq" else None
        if against_config and not self._told_g_idx:
            self._told_g_idx = True  # once per quantizer, not per layer
            log.warning("%s (and maybe other layers): quantization_config.desc_act is false but g_idx is an "
                        "act-order permutation; using g_idx (vLLM would ignore it: wrong groups)", against_config)
        want = self.int4_layout
        why = self._pairs_blocker(layer) if want != "mma" else self._mma_blocker(layer)
        if why and want in ("pairs", "mma"):  # on every backend: the setting asks for a layout it cannot have
            raise ValueError(f"{layer.prefix}: int4_layout '{want}' does not apply: {why} "
                             "(use int4_layout 'auto' or 'checkpoint')")
        if want in ("pairs", "mma") and not layer.wna16_kernel and not self._told_reference:
            self._told_reference = True  # once per quantizer, not per layer
            log.warning("int4_layout '%s' has no effect on the reference backend (it dequantizes the checkpoint's "
                        "packing and runs torch.matmul)", want)
        if not layer.wna16_kernel or why or want == "checkpoint":
            return
        if want == "mma":
            self._repack_mma(layer)
        else:
            self._repack_pairs(layer)

    def _pairs_blocker(self, layer) -> "str | None":
        """Why the pairs layout cannot hold this layer's weight, or None if it can."""
        k, gs = layer.wna16_k, layer.wna16_group
        if self.bits != 4:
            return "the weights are not 4-bit"
        if layer.wna16_dtype not in PAIRS_DTYPES:
            return f"the model dtype {layer.wna16_dtype} is not float16/bfloat16 (model.dtype / --dtype)"
        if pairs_tile_k(k, gs) is None:
            bad = [f"{what} {v}" for what, v in (("group_size", gs), ("in features", k)) if v % 64]
            return f"{' and '.join(bad)} {'is' if len(bad) == 1 else 'are'} not a multiple of 64"
        return None

    def _mma_blocker(self, layer) -> "str | None":
        """Why the mma layout cannot hold this layer's weight here, or None if it can."""
        if self.bits != 4:
            return "the weights are not 4-bit"
        why = (w4_mma.mma_blocker(layer.wna16_k, layer.wna16_n, layer.wna16_group, layer.wna16_dtype)
               or w4_mma.groups_blocker(layer.scales.data, layer.wzeros))
        if why or not layer.wna16_kernel:  # the reference path repacks nothing: the runtime does not matter
            return why
        return w4_mma.runtime_blocker(layer.qweight.device)

    def _unpacked_columns(self, layer, c0: int, c1: int) -> torch.Tensor:
        """The 4-bit ints of output columns [c0, c1) as [K, c1 - c0] (act-order applied)."""
        qw = layer.qweight.data
        if self.fmt == "awq":
            return unpack_cols(qw[:, c0 // 8:c1 // 8], 4, awq_order=True)
        return unpack_rows(qw[:, c0:c1], 4)

    def _repack_mma(self, layer):
        """Repack the 4-bit weight, scales and zero points into the mma layout (``kernels/w4_mma.py``);
        a gate|up pair (``layer.gate_up``) with its rows interleaved for the fused SwiGLU epilogue."""
        n = layer.wna16_n
        half = n // 2
        gated = bool(getattr(layer, "gate_up", False)) and layer.output_sizes == [half, half] and half % 8 == 0
        # q|k|v whose q and k heads the model rotates in full (rope_heads, set by the attention
        # layer): their rows go to the rotary layout, so the kernel can apply RoPE on the way out
        heads, hd = getattr(layer, "rope_heads", 0), getattr(layer, "head_dim", 0)
        rope = (heads, hd) if self.fuse_norm and heads and hd % 16 == 0 and not gated else None
        order = w4_mma.interleave_heads(torch.arange(n), *rope) if rope else None

        def columns(c0, c1):  # the 4-bit ints of layout columns [c0, c1) (c0, c1 multiples of 16)
            if rope:  # the permutation stays inside heads: read the span it covers
                idx = order[c0:c1]
                lo, hi = int(idx.min()), int(idx.max()) + 1
                return self._unpacked_columns(layer, lo, hi)[:, idx - lo]
            if not gated:
                return self._unpacked_columns(layer, c0, c1)
            g, u = (self._unpacked_columns(layer, h * half + c0 // 2, h * half + c1 // 2) for h in (0, 1))
            return w4_mma.interleave_gate_up(torch.cat([g, u], dim=1))
        # column chunks: the unpacked ints take 4-8 bytes per weight
        parts = [w4_mma.pack_mma(columns(c0, min(c0 + 4096, n))) for c0 in range(0, n, 4096)]
        layer.qweight = torch.nn.Parameter(torch.cat(parts, dim=0), requires_grad=False)
        scales, zeros = layer.scales.data, layer.wzeros
        if gated:
            scales, zeros = w4_mma.interleave_gate_up(scales), w4_mma.interleave_gate_up(zeros)
        if rope:
            scales, zeros = scales[:, order.to(scales.device)], zeros[:, order.to(zeros.device)]
        layer.wna16_gated = gated
        layer.wna16_rope = rope
        sc, zb = w4_mma.pack_mma_groups(scales, zeros)
        del layer.scales
        layer.register_buffer("mma_scales", sc, persistent=False)
        layer.register_buffer("wzeros", zb, persistent=False)
        layer.wna16_layout = "mma"

    def _repack_pairs(self, layer):
        """Repack the 4-bit weight into the pairs layout (``kernels/w4_pairs.py``)."""
        tk = pairs_tile_k(layer.wna16_k, layer.wna16_group)
        n = layer.wna16_n
        # column chunks: the unpacked ints take 4-8 bytes per weight
        parts = [pack_pairs(self._unpacked_columns(layer, c0, min(c0 + 4096, n)), tk) for c0 in range(0, n, 4096)]
        layer.qweight = torch.nn.Parameter(torch.cat(parts, dim=1), requires_grad=False)
        layer.wna16_tile_k = tk
        layer.wna16_layout = "pairs"

    # -- conformance protocol (kvforge.testing.quantizer) -----------------------------------
    def make_test_weights(self, input_size, output_sizes, params_dtype, generator):
        from .conformance import wna16_test_weights
        return wna16_test_weights(self, input_size, list(output_sizes), generator)

    def dequantize_test_weights(self, tensors, input_size, output_sizes):
        from .conformance import STASH
        return STASH.get(tensors)

    # -- compute ---------------------------------------------------------------------------
    def dequantized(self, layer, dtype: torch.dtype) -> torch.Tensor:
        """W^T [K, N] in ``dtype`` (reference path), in the layout's column order (gate|up
        interleaved where ``layer.wna16_gated``, q|k heads where ``layer.wna16_rope``)."""
        if layer.wna16_layout == "mma":
            return w4_mma.dequantize_mma(layer.qweight, layer.mma_scales, layer.wzeros, group_size=layer.wna16_group,
                                         dtype=dtype)
        if layer.wna16_tile_k:
            return dequantize_pairs(layer.qweight, layer.scales, layer.wzeros, group_size=layer.wna16_group,
                                    tile_k=layer.wna16_tile_k, dtype=dtype)
        return dequantize_wna16(layer.qweight, layer.scales, layer.wzeros, bits=self.bits,
                                group_size=layer.wna16_group, pack_k=self.fmt != "awq",
                                awq_order=self.fmt == "awq", dtype=dtype, g_idx=layer.g_idx_ref)

    def apply_silu_and_mul(self, layer, x, bias):
        """The fused SwiGLU of a gate|up pair repacked interleaved (mma layout, no bias):
        x [..., K] -> silu(gate) * up [..., N / 2] in x's dtype, from the kernel's epilogue
        (M <= 64) or dequantize + matmul + the activation; None for any other layer."""
        if not getattr(layer, "wna16_gated", False) or bias is not None:
            return None
        x2 = self._kernel_input(layer, x)
        if x2.dtype in w4_mma.DTYPES:
            y = w4_mma.mma_gemm(x2, layer.qweight, layer.mma_scales, layer.wzeros, group_size=layer.wna16_group,
                                n=layer.wna16_n, silu_and_mul=True)
        else:
            y = w4_mma.silu_and_mul_interleaved(x2 @ self.dequantized(layer, x2.dtype))
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def apply_add_rmsnorm(self, layer, x, residual, norm_weight, eps, bias, silu_and_mul=False, rope=None):
        """The pre-norm folded into the mma kernel's prologue (``w4_mma.mma_gemm_rmsnorm``)
        for T <= ``fuse_norm_max_tokens`` tokens, and with ``rope`` (positions, rotary) the q|k
        heads rotated in its epilogue where the layer is in the rotary layout (else by the rotary
        kernel after it); None elsewhere: another layout, a bias, GPTQ act-order (x would be
        normalized in the permuted order), a gate|up layer asked for [gate | up], rows too long
        for shared memory."""
        if not (self.fuse_norm and layer.wna16_kernel and layer.wna16_layout == "mma" and bias is None
                and layer.perm is None and silu_and_mul == bool(getattr(layer, "wna16_gated", False))
                and x.dim() == 2 and 1 <= x.shape[0] <= self.fuse_norm_max_tokens and x.dtype in w4_mma.DTYPES):
            return None
        if not w4_mma.norm_fits(x.shape[0], x.shape[1], x.element_size(), x.device):
            return None  # the whole rows do not fit in shared memory beside the kernel's own
        fused_rope = None
        if layer.wna16_rope is not None:  # rotary layout: the epilogue rotates (or only restores head order)
            if rope is not None and rope[1].rotary_dim == layer.wna16_rope[1]:
                positions, rotary = rope
                fused_rope, rope = (*layer.wna16_rope, positions, rotary.cos, rotary.sin), None
            else:
                fused_rope = (*layer.wna16_rope, None, None, None)
        y, r = w4_mma.mma_gemm_rmsnorm(x, residual, norm_weight, eps, layer.qweight, layer.mma_scales,
                                       layer.wzeros, group_size=layer.wna16_group, n=layer.wna16_n,
                                       silu_and_mul=silu_and_mul, rope=fused_rope)
        if rope is not None:  # asked for, but not laid out for the epilogue: the rotary kernel
            y = layer.rotate(y, *rope)
        return y, r

    @staticmethod
    def _kernel_input(layer, x):
        """x [..., K] -> [T, K], its columns in the repacked weight's K order (GPTQ act-order)."""
        x2 = x.reshape(-1, x.shape[-1])
        return x2.index_select(1, layer.perm) if layer.wna16_kernel and layer.perm is not None else x2

    def apply(self, layer, x, bias):
        x2 = self._kernel_input(layer, x)
        if layer.wna16_kernel:
            if layer.wna16_layout == "mma" and x2.dtype in w4_mma.DTYPES:
                y = w4_mma.mma_gemm(x2, layer.qweight, layer.mma_scales, layer.wzeros, group_size=layer.wna16_group,
                                    n=layer.wna16_n, rope_layout=layer.wna16_rope)  # (back in head order)
            elif layer.wna16_layout == "mma":
                y = x2 @ self.dequantized(layer, x2.dtype)
                if layer.wna16_rope:
                    y = w4_mma.deinterleave_heads(y, *layer.wna16_rope)
            elif layer.wna16_tile_k and x2.dtype in PAIRS_DTYPES:
                y = pairs_gemm(x2, layer.qweight, layer.scales, layer.wzeros, group_size=layer.wna16_group,
                               tile_k=layer.wna16_tile_k, n=layer.wna16_n)
            elif layer.wna16_tile_k:
                y = x2 @ self.dequantized(layer, x2.dtype)
            else:
                y = wna16_gemm(x2, layer.qweight, layer.scales, layer.wzeros, bits=self.bits,
                               group_size=layer.wna16_group, pack_k=self.fmt != "awq", awq_order=self.fmt == "awq",
                               n=layer.wna16_n)
        else:
            y = x2 @ self.dequantized(layer, x.dtype)
        if layer.wna16_gated:  # [gate | up] in checkpoint order
            y = w4_mma.deinterleave_gate_up(y)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], y.shape[-1])
