"""Tensor-parallel linear layers (Megatron-LM, Shoeybi et al. 2019, sec. 3).

A column-parallel layer splits its output features across the tensor-parallel ranks
(each rank computes its slice, no communication); a row-parallel layer splits its input
features and sums the partial products with an all-reduce. An MLP is column-parallel
``gate|up`` then row-parallel ``down``; attention is column-parallel ``q|k|v`` (whole
heads per rank) then row-parallel ``o`` — one all-reduce per block.

Both are :class:`~kvforge.layers.linear.FusedLinear` built with the rank-local sizes, so
the quantization method creates, loads and multiplies rank-local weights exactly as in
the single-rank case. Checkpoint tensors are cut to this rank's slice *before* the
method's ``weight_loader`` sees them, using attributes the method declares on each
parameter (see ``docs/distributed.md``, "Quantized layers"):

* ``output_dim`` (int or None): the dimension the fused outputs are concatenated along.
  A column-parallel layer keeps, of each fused shard's checkpoint tensor, the rows of its
  rank's output features.
* ``input_dim`` (int or None): the dimension that runs along the input features. A
  row-parallel layer keeps 1/tp of the checkpoint tensor along it.

The extent of a tensor along either dimension may be any fixed multiple or fraction of
the feature count (int32 packing, quantization groups): the slice is scaled in
proportion and must land on whole elements. A parameter without the attribute is
loaded whole on every rank (replicated: per-tensor scales, per-output scales of a
row-parallel layer). With one rank (``tp_size == 1``) nothing is cut and the layers are
exactly :class:`FusedLinear`.
"""
from __future__ import annotations

import torch

from kvforge.distributed import parallel_state as ps
from kvforge.distributed.communication import tp_all_reduce
from kvforge.interfaces import QuantizationConfig
from kvforge.layers.linear import FusedLinear


def _proportional_slice(tensor: torch.Tensor, dim: int, full: int, start: int, size: int, what: str) -> torch.Tensor:
    """``tensor`` spans ``full`` features along ``dim`` (at a fixed ratio); keep features
    ``[start, start + size)``."""
    extent = tensor.shape[dim]
    lo, n = start * extent, size * extent
    if lo % full or n % full:
        raise ValueError(f"{what}: features [{start}, {start + size}) of {full} do not map to whole elements of "
                         f"a checkpoint tensor with {extent} along dim {dim} (packing or group size does not "
                         "divide the per-rank slice)")
    return tensor.narrow(dim, lo // full, n // full)


class ColumnParallelLinear(FusedLinear):
    """Output features split across tensor-parallel ranks: ``x [T, in] -> [T, sum(local sizes)]``.

    Args:
        output_sizes: global out features of each fused projection.
        shard_slices: per projection ``(start, size)`` of this rank's output features
            (default: an even split of every projection; each must divide by tp).
        parallel: False builds an unsharded (replicated) layer whatever the tp size.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, quant_config: QuantizationConfig,
                 prefix: str, params_dtype: torch.dtype, *, shard_slices: list[tuple[int, int]] | None = None,
                 parallel: bool = True) -> None:
        tp, rank = (ps.get_tp_size(), ps.get_tp_rank()) if parallel else (1, 0)
        if shard_slices is None:
            bad = [s for s in output_sizes if s % tp]
            if bad:
                raise ValueError(f"{prefix}: output sizes {list(output_sizes)} do not divide by "
                                 f"tensor_parallel_size {tp}")
            shard_slices = [(rank * (s // tp), s // tp) for s in output_sizes]
        self.tp_size = tp
        self.global_output_sizes = list(output_sizes)
        self.shard_slices = list(shard_slices)
        super().__init__(input_size, [n for _, n in self.shard_slices], bias, quant_config, prefix, params_dtype)

    def _local(self, tensor: torch.Tensor, dim: int, shard: int, what: str) -> torch.Tensor:
        start, size = self.shard_slices[shard]
        return _proportional_slice(tensor, dim, self.global_output_sizes[shard], start, size, what)

    def load(self, param_name: str, tensor: torch.Tensor, shard: int | None) -> None:
        if self.tp_size > 1:
            param = getattr(self, param_name, None)
            dim = 0 if param_name == "bias" else getattr(param, "output_dim", None)
            what = f"{self.prefix}.{param_name}"
            if dim is not None:
                if shard is not None or len(self.global_output_sizes) == 1:
                    tensor = self._local(tensor, dim, shard or 0, what)
                else:  # an already-fused checkpoint tensor: cut every projection, keep the rank's rows
                    total = sum(self.global_output_sizes)
                    extent = tensor.shape[dim]
                    if any(s * extent % total for s in self.global_output_sizes):
                        raise ValueError(f"{what}: fused tensor of {extent} along dim {dim} does not split "
                                         f"into {self.global_output_sizes}")
                    parts = tensor.split([s * extent // total for s in self.global_output_sizes], dim)
                    tensor = torch.cat([self._local(p, dim, i, what) for i, p in enumerate(parts)], dim)
        super().load(param_name, tensor, shard)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel fused projections split evenly (``gate|up``): each rank keeps its
    slice of every projection, so ``silu(gate) * up`` stays rank-local
    (:meth:`~kvforge.layers.linear.FusedLinear.silu_and_mul`)."""

    gate_up = True


class QKVParallelLinear(ColumnParallelLinear):
    """Fused ``q|k|v`` with whole attention heads per rank.

    Query heads are split evenly. Key/value heads are split evenly when there are at
    least as many as ranks; otherwise each KV head is replicated on ``tp / num_kv_heads``
    consecutive ranks, which are exactly the ranks whose query heads use it (GQA group
    ``h // (num_heads / num_kv_heads)``).

    Attributes:
        num_heads, num_kv_heads: heads of this rank.

    Raises:
        ValueError: heads that cannot be split that way.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 quant_config: QuantizationConfig, prefix: str, params_dtype: torch.dtype,
                 *, parallel: bool = True) -> None:
        tp, rank = (ps.get_tp_size(), ps.get_tp_rank()) if parallel else (1, 0)
        if num_heads % tp:
            raise ValueError(f"{prefix}: {num_heads} attention heads do not divide by tensor_parallel_size {tp}")
        if num_kv_heads >= tp:
            if num_kv_heads % tp:
                raise ValueError(f"{prefix}: {num_kv_heads} KV heads do not divide by tensor_parallel_size {tp}")
            kv_local, kv_start = num_kv_heads // tp, rank * (num_kv_heads // tp)
        else:
            if tp % num_kv_heads:
                raise ValueError(f"{prefix}: tensor_parallel_size {tp} is not a multiple of the {num_kv_heads} "
                                 "KV heads (needed to replicate them)")
            kv_local, kv_start = 1, rank // (tp // num_kv_heads)
        q_local = num_heads // tp
        self.num_heads, self.num_kv_heads = q_local, kv_local
        self.head_dim = d = head_dim
        #: heads (q and k) the model rotates in full: the quantization method may lay their
        #: rows out for a fused rotation (``FusedLinear.forward_prenorm(rope=...)``); 0: none
        self.rope_heads = 0
        slices = [(rank * q_local * d, q_local * d), (kv_start * d, kv_local * d), (kv_start * d, kv_local * d)]
        super().__init__(hidden_size, [num_heads * d, num_kv_heads * d, num_kv_heads * d], bias, quant_config,
                         prefix, params_dtype, shard_slices=slices, parallel=parallel)


    def rotate(self, y: torch.Tensor, positions: torch.Tensor, rotary) -> torch.Tensor:
        """RoPE on the q and k heads of this layer's output y [T, q + 2 kv] (``rotary``, a
        ``kvforge.layers.rotary.RotaryEmbedding``, at int64 ``positions`` [T]); returns y,
        rotated in place (the torch path's rotated copies are written back)."""
        t, d, nq, nk = y.shape[0], self.head_dim, self.output_sizes[0], self.output_sizes[1]
        q, k = y[:, :nq], y[:, nq:nq + nk]
        q2, k2 = rotary(positions, q.view(t, -1, d), k.view(t, -1, d))
        if q2.data_ptr() != q.data_ptr():
            q.copy_(q2.reshape(t, -1))
            k.copy_(k2.reshape(t, -1))
        return y


class RowParallelLinear(FusedLinear):
    """Input features split across ranks: ``x [T, in / tp] -> [T, out]``, partial sums all-reduced.

    The bias (never split) is added once, after the reduction. ``reduce_results=False``
    returns the partial sum (the bias then added on tp rank 0 only) so a caller can fuse
    several partial results into one all-reduce.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool, quant_config: QuantizationConfig,
                 prefix: str, params_dtype: torch.dtype, *, reduce_results: bool = True,
                 parallel: bool = True) -> None:
        tp, rank = (ps.get_tp_size(), ps.get_tp_rank()) if parallel else (1, 0)
        if input_size % tp:
            raise ValueError(f"{prefix}: input size {input_size} does not divide by tensor_parallel_size {tp}")
        self.tp_size, self.tp_rank = tp, rank
        self.global_input_size = input_size
        self.reduce_results = reduce_results
        super().__init__(input_size // tp, [output_size], bias, quant_config, prefix, params_dtype)

    def load(self, param_name: str, tensor: torch.Tensor, shard: int | None) -> None:
        param = getattr(self, param_name, None)
        dim = None if param_name == "bias" else getattr(param, "input_dim", None)
        if self.tp_size > 1 and dim is not None:
            extent = tensor.shape[dim]
            if extent % self.tp_size:
                raise ValueError(f"{self.prefix}.{param_name}: checkpoint extent {extent} along input dim {dim} "
                                 f"does not divide by tensor_parallel_size {self.tp_size}")
            part = extent // self.tp_size
            tensor = tensor.narrow(dim, self.tp_rank * part, part)
        try:
            super().load(param_name, tensor, shard)
        except ValueError as e:
            if self.tp_size > 1 and dim is None and param_name != "bias":
                raise ValueError(f"{e} (tensor parallelism: the quantization method declares no `input_dim` on "
                                 f"parameter {param_name!r}, so it is loaded whole; a parameter that runs along "
                                 "the input features must declare it)") from e
            raise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x)
        y = self.method.apply(self, x, None)
        if self.reduce_results:
            y = tp_all_reduce(y)
            return y + self.bias if self.bias is not None else y
        if self.bias is not None and self.tp_rank == 0:
            y = y + self.bias
        return y
