"""The weight-only Triton GEMM shrinks a launch config Triton refuses for shared memory (found on
the H200: GPTQ's M = 33 tiles with fp32 activations asked for 256 KB, over the 227 KB limit)
instead of failing the layer; the fitted config is remembered per shape. The launch itself is
replaced by a stand-in that refuses as Triton does, so this runs on the CPU."""
from __future__ import annotations

import pytest
import torch

from kvforge_plugins.quant.kernels import wna16

OutOfResources = pytest.importorskip("triton.runtime.errors").OutOfResources


def test_refused_config_is_shrunk_and_remembered(monkeypatch):
    tried = []

    def fake_run(x, qweight, scales, zeros, bits, group_size, pack_k, awq_order, n, cfg):
        tried.append((cfg["num_stages"], cfg["BLOCK_N"], cfg["BLOCK_K"]))
        if cfg["num_stages"] > 1 or cfg["BLOCK_N"] > 128:
            raise OutOfResources(262144, 232448, "shared memory")
        return torch.zeros(x.shape[0], n)

    monkeypatch.setattr(wna16, "_run", fake_run)
    monkeypatch.setattr(wna16, "_FITTED", {})
    x = torch.randn(33, 256)
    args = dict(bits=4, group_size=128, pack_k=True, awq_order=False, n=512)
    cfg = dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, joined=True, num_stages=3)
    assert wna16.wna16_gemm(x, None, None, None, config=cfg, **args).shape == (33, 512)
    assert tried == [(3, 256, 64), (2, 256, 64), (1, 256, 64), (1, 128, 64)]
    tried.clear()
    wna16.wna16_gemm(x, None, None, None, config=cfg, **args)
    assert tried == [(1, 128, 64)]  # the fitted config, first time


def test_nothing_smaller_left_raises_triton_error(monkeypatch):
    def refuse(*a):
        raise OutOfResources(262144, 232448, "shared memory")
    monkeypatch.setattr(wna16, "_run", refuse)
    monkeypatch.setattr(wna16, "_FITTED", {})
    with pytest.raises(OutOfResources):
        wna16.wna16_gemm(torch.randn(5, 256), None, None, None, bits=4, group_size=128, pack_k=False,
                         awq_order=True, n=256, config=dict(BLOCK_M=16, BLOCK_N=256, BLOCK_K=64, swap_ab=True))


def test_smaller_keeps_tl_dot_sides_of_16():
    # N-packed per-field MMAs need BLOCK_N / 8 >= 16: BLOCK_N stays 128, BLOCK_K halves instead
    cfg = {**wna16.DEFAULTS, "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 64, "num_stages": 1, "swap_ab": True}
    got = wna16._smaller(cfg, 4, 128, False, 4096)
    assert (got["BLOCK_N"], got["BLOCK_K"]) == (128, 32)
    assert wna16._smaller({**got, "BLOCK_K": 16}, 4, 128, False, 4096) is None
