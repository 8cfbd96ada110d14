"""Linear layers whose weight format is owned by the quantization method."""
from __future__ import annotations

import torch

from kvforge.interfaces import LinearMethod, QuantizationConfig
from kvforge.layers.activation import silu_and_mul


class FusedLinear(torch.nn.Module):
    """``y = x W^T + b`` for one or several fused projections (e.g. q|k|v, gate|up).

    Args:
        input_size: in features.
        output_sizes: out features of each fused projection; checkpoint tensors are
            loaded per projection with ``load(name, tensor, shard_index)``.
        bias: whether the layer has a bias (dense, in ``params_dtype``).
        quant_config: chooses the :class:`LinearMethod` for ``prefix``.
    Shapes: x [T, input_size] -> [T, sum(output_sizes)].
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, quant_config: QuantizationConfig,
                 prefix: str, params_dtype: torch.dtype) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.prefix = prefix
        self.method: LinearMethod = quant_config.get_linear_method(prefix)
        self.method.create_weights(self, input_size, self.output_sizes, params_dtype)
        offsets = [0]
        for s in self.output_sizes:
            offsets.append(offsets[-1] + s)
        self._offsets = offsets
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(offsets[-1], dtype=params_dtype), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def load(self, param_name: str, tensor: torch.Tensor, shard: int | None) -> None:
        """Load checkpoint tensor ``tensor`` into parameter ``param_name`` (shard None = whole).

        Raises:
            ValueError: the method's format has no such parameter (with the method's
                ``unknown_param_hint``, e.g. a quantized tensor in a checkpoint loaded as
                unquantized), or its loader refuses the tensor; prefixed with the parameter.
        """
        param = getattr(self, param_name, None)
        if param is None:
            hint = getattr(self.method, "unknown_param_hint", lambda name: "")(param_name)
            raise ValueError(f"{self.prefix}: no parameter {param_name!r} in this layer's weight format{hint}")
        if param_name == "bias":
            lo, hi = (0, self._offsets[-1]) if shard is None else self._offsets[shard:shard + 2]
            if tensor.shape != (hi - lo,):
                raise ValueError(f"{self.prefix}.bias: expected shape {(hi - lo,)}, got {tuple(tensor.shape)}")
            param.data[lo:hi].copy_(tensor)
            return
        if len(self.output_sizes) == 1:
            shard = None
        # A parameter with ``load_raw`` (e.g. float8 weights, scales whose dtype is checked) gets
        # the checkpoint tensor as stored; its loader checks and converts the dtype itself.
        if param.is_floating_point() and not getattr(param, "load_raw", False):
            tensor = tensor.to(param.dtype)
        try:
            param.weight_loader(param, tensor, shard)
        except ValueError as e:
            raise ValueError(f"{self.prefix}.{param_name}: {e}") from e

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)

    #: True for a gate|up pair (``MergedColumnParallelLinear``): the method may lay the weight
    #: out for a fused SwiGLU (:meth:`silu_and_mul`).
    gate_up = False

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a gate|up layer: x [T, in] -> [T, out / 2] (SwiGLU, Shazeer
        2020), through the method's fused path where it has one
        (``LinearMethod.apply_silu_and_mul``), else ``self(x)`` then the activation. (The
        fused path calls the method directly: forward hooks on this layer do not run there.)"""
        fused = getattr(self.method, "apply_silu_and_mul", None) if self.gate_up else None
        y = fused(self, x, self.bias) if fused is not None else None
        return y if y is not None else silu_and_mul(self(x))

    def forward_prenorm(self, x: torch.Tensor, residual: torch.Tensor, norm, silu_and_mul: bool = False,
                        rope: "tuple | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A pre-norm block's ``h, r = norm(x, residual)`` then ``self(h)`` (``silu_and_mul``:
        :meth:`silu_and_mul` of h): x, residual [T, in] -> (y, r = x + residual). ``norm`` is
        a ``kvforge.layers.layernorm.RMSNorm``. ``rope`` (positions int64 [T], a
        ``kvforge.layers.rotary.RotaryEmbedding``), for a q|k|v layer: y's q and k heads come
        back rotated. The method folds the norm (and the rotation) into its GEMM where it can
        (``LinearMethod.apply_add_rmsnorm``: one kernel instead of three, e.g. the int4 mma
        kernel at batch <= ``fuse_norm_max_tokens``, 2 by default). Raises ValueError for
        ``silu_and_mul`` on a layer that is not a gate|up pair, or ``rope`` on one that is not q|k|v."""
        if silu_and_mul and not self.gate_up:
            raise ValueError(f"{self.prefix}: silu_and_mul needs a gate|up layer (MergedColumnParallelLinear)")
        if rope is not None and not hasattr(self, "rotate"):
            raise ValueError(f"{self.prefix}: rope needs a q|k|v layer (QKVParallelLinear)")
        out = self.method.apply_add_rmsnorm(self, x, residual, norm.weight, norm.eps, self.bias, silu_and_mul, rope)
        if out is not None:
            return out
        h, r = norm(x, residual)
        y = self.silu_and_mul(h) if silu_and_mul else self(h)
        if rope is not None:
            y = self.rotate(y, *rope)
        return y, r
