"""GPTQ act-order (``desc_act``): the ``g_idx`` tensor maps each input row to its
quantization group (Frantar et al., "GPTQ", arXiv:2210.17323, sec. 4 "act-order";
AutoGPTQ / GPTQModel ``QuantLinear.g_idx``).

``g_idx`` is honoured whenever it is not the trivial ``arange(K) // group_size``, whatever
``quantization_config.desc_act`` says. vLLM reads it only when ``desc_act`` is true, so a
checkpoint whose config says ``desc_act: false`` but whose ``g_idx`` is permuted (a config
edited or written by a tool that forgot the flag) decodes there with the wrong groups'
scales: garbage text with no error. The tensor is what the packer used, so kvforge follows
it (the caller logs a warning naming the tensor and the field).
"""
from __future__ import annotations

import logging

import torch

from .common import pack_rows, tensor_name, unpack_rows

log = logging.getLogger("kvforge.quant")


def _check_g_idx(layer, g: torch.Tensor) -> None:
    """Group indices in range and one input order for all fused shards.

    Raises:
        ValueError: naming the checkpoint tensor: an index outside [0, groups), or shards
            (q|k|v, gate|up) whose g_idx differ (they share one GEMM, so one input order).
    """
    groups = layer.scales.shape[0]
    for shard, gi in enumerate(g):
        if gi.min() < 0 or gi.max() >= groups:
            raise ValueError(f"{tensor_name(layer.g_idx, shard)}: group index out of range [0, {groups}) "
                             f"(min {int(gi.min())}, max {int(gi.max())})")
    if not bool((g == g[0:1]).all()):
        raise ValueError(f"{tensor_name(layer.g_idx, None)}: the fused projections have different act-order "
                         "g_idx; kvforge runs them as one GEMM and needs one input order")


def apply_act_order(layer, desc_act: bool, bits: int) -> str | None:
    """Consume ``layer.g_idx`` (int [shards, K], loaded from the checkpoint) after loading.

    Trivial g_idx: nothing to do. Otherwise the reference path keeps ``layer.g_idx_ref``
    [K]; the kernel path (``layer.wna16_kernel``) permutes ``layer.qweight``'s rows so
    groups are contiguous and sets ``layer.perm`` [K] (the activation is gathered with it),
    or falls back to the reference when the groups are not all ``group_size`` rows.
    Returns the g_idx tensor name(s) when a permutation was honoured although ``desc_act``
    is false (for the caller's warning), else None.

    Raises:
        ValueError: see :func:`_check_g_idx`.
    """
    k, gs = layer.wna16_k, layer.wna16_group
    g = layer.g_idx.data.long()
    trivial = torch.arange(k, device=g.device) // gs
    # A row-parallel rank r holds rows [r*k, (r+1)*k) of a trivial g_idx: its groups start at
    # r*k/gs (kvforge slices the scales alike). desc_act false has always accepted that.
    if not desc_act and torch.equal(g - g.min(), trivial.expand_as(g)):
        del layer.g_idx
        return None
    _check_g_idx(layer, g)
    against_config = None if desc_act else tensor_name(layer.g_idx, None)
    del layer.g_idx
    g = g[0]
    if torch.equal(g, trivial):
        return None
    layer.g_idx_ref = g
    if layer.wna16_kernel:
        _permute_rows(layer, g, trivial, bits)
    return against_config


def _permute_rows(layer, g: torch.Tensor, trivial: torch.Tensor, bits: int) -> None:
    """Kernel path: sort qweight's rows by group (``layer.perm``), or fall back to the reference."""
    perm = torch.argsort(g, stable=True)
    if not torch.equal(g[perm], trivial):
        log.warning("%s: g_idx groups are not of size %d; using the dequantize reference", layer.prefix,
                    layer.wna16_group)
        layer.wna16_kernel = False
        return
    q = unpack_rows(layer.qweight.data, bits)[perm]
    layer.qweight = torch.nn.Parameter(pack_rows(q, bits), requires_grad=False)
    layer.perm = perm
    layer.g_idx_ref = None
