"""GPTQ act-order (``desc_act``): the ``g_idx`` tensor maps each input row to its
quantization group (Frantar et al., "GPTQ", arXiv:2210.17323, sec. 4 "act-order";
AutoGPTQ / GPTQModel ``QuantLinear.g_idx``).

``g_idx`` is honoured whenever it is not the trivial ``arange(K) // group_size``, whatever
``quantization_config.desc_act`` says. vLLM reads it only when ``desc_act`` is true, so a
checkpoint whose config says ``desc_act: false`` but whose ``g_idx`` is permuted (a config
edited or written by a tool that forgot the flag) decodes there with the wrong groups'
scales: garbage text with no error. The tensor is what the packer used, so kvforge follows
it (the caller logs a warning naming the tensor and the field).

Tensor parallelism: a row-parallel layer (o_proj, down_proj) gets 1/tp of the input rows,
but an act-order group's rows are spread over every rank. With ``desc_act`` true each rank
therefore keeps the scales and zero points of all groups (``layer.wna16_all_groups``, set by
``weight_only.create_weights``) and its slice of g_idx, which holds global group numbers;
:func:`_own_groups` trims them to the rank's groups where its rows fill whole groups (a
trivial g_idx, or one permuted within the rank's rows), else they stay whole and the layer
takes the dequantize reference (the kernels need groups of ``group_size`` consecutive rows).
``desc_act`` false splits the scales by group, which fits only a slice of the trivial g_idx.
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
        ValueError: see :func:`_check_g_idx`; or a non-trivial g_idx under ``desc_act`` false
            on a row-parallel split (its scales were split by group, so rows of other ranks'
            groups have none), naming the tensor and the field.
    """
    k, gs = layer.wna16_k, layer.wna16_group
    g = layer.g_idx.data.long()
    trivial = torch.arange(k, device=g.device) // gs
    # A row-parallel rank r holds rows [r*k, (r+1)*k) of a trivial g_idx: its groups start at
    # r*k/gs (kvforge slices the scales alike). desc_act false has always accepted that.
    if not desc_act and torch.equal(g - g.min(), trivial.expand_as(g)):
        del layer.g_idx
        return None
    all_groups = getattr(layer, "wna16_all_groups", False)
    if getattr(layer, "global_input_size", k) != k and not all_groups:
        raise ValueError(f"{tensor_name(layer.g_idx, None)}: g_idx is an act-order permutation but "
                         "quantization_config.desc_act is false; with tensor parallelism kvforge splits a "
                         "row-parallel layer's scales by group unless desc_act is true, so it cannot follow "
                         "this g_idx: set desc_act to true in config.json (or use tensor_parallel_size 1)")
    _check_g_idx(layer, g)
    against_config = None if desc_act else tensor_name(layer.g_idx, None)
    del layer.g_idx
    g = g[0]
    if all_groups:
        g = _own_groups(layer, g, trivial)
    if torch.equal(g, trivial):
        return None
    layer.g_idx_ref = g
    if layer.wna16_kernel:
        _permute_rows(layer, g, trivial, bits)
    return against_config


def _own_groups(layer, g: torch.Tensor, trivial: torch.Tensor) -> torch.Tensor:
    """A row-parallel rank's g_idx ``g`` [k] (global groups; ``layer.scales``/``wzeros`` hold all):
    when its rows fill whole groups (``group_size`` rows each, but the last), keep only those
    groups' scales and zero points and return ``g`` renumbered to them (then the layer is like
    an unsplit one, kernels included, and a trivial slice keeps its sliced memory); else ``g``."""
    used, local = torch.unique(g, sorted=True, return_inverse=True)
    if not torch.equal(torch.sort(local).values, trivial):
        return g
    layer.scales = torch.nn.Parameter(layer.scales.data[used].contiguous(), requires_grad=False)
    layer.wzeros = layer.wzeros[used.to(layer.wzeros.device)].contiguous()
    return local


def _permute_rows(layer, g: torch.Tensor, trivial: torch.Tensor, bits: int) -> None:
    """Kernel path: sort qweight's rows by group (``layer.perm``), or fall back to the reference."""
    perm = torch.argsort(g, stable=True)
    if not torch.equal(g[perm], trivial):  # (always so for groups kept whole by a row-parallel rank)
        why = " (a row-parallel rank's rows of act-order groups)" if getattr(layer, "wna16_all_groups", False) else ""
        log.warning("%s: g_idx groups are not of size %d%s; using the dequantize reference", layer.prefix,
                    layer.wna16_group, why)
        layer.wna16_kernel = False
        return
    q = unpack_rows(layer.qweight.data, bits)[perm]
    layer.qweight = torch.nn.Parameter(pack_rows(q, bits), requires_grad=False)
    layer.perm = perm
    layer.g_idx_ref = None
