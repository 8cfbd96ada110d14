"""The "mma" int4 layout (``kernels/w4_mma.py``) and its CUDA kernel (``w4_mma.cu``).

On the CPU: the packer against a word worked out by hand from the layout's definition, the
round trips, and an emulation of the kernel's tensor-core math built from the PTX ISA's
m16n8k16 fragment layouts (independently of the packer), which must reproduce ``x @ W_ref``:
a packing that put a nibble where the MMA does not read it fails there. On a GPU: the kernel
and the ``int4_layout: mma`` layers against the fp32 reference. Fresh random data each run.
Bounds: max|y - ref| / max|ref| <= 1e-2 (bf16 output) / 2e-3 (fp16).
"""
from __future__ import annotations

import os

import pytest
import torch

from kvforge_plugins.quant.kernels import w4_mma
from kvforge_plugins.quant.kernels.w4_mma import (dequantize_mma, mma_blocker, pack_mma, pack_mma_groups,
                                                  unpack_mma, unpack_mma_groups)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BOUND = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF)


def _quant(k, n, group, gen):
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    s = (torch.rand(k // group, n, generator=gen) * 0.004 + 0.001).half().float()  # fp16, as checkpoints store them
    z = torch.randint(0, 16, (k // group, n), generator=gen, dtype=torch.int32)
    g = torch.arange(k) // group
    return q, s, z, (q - z[g]).float() * s[g]


def test_word_worked_by_hand(gen):
    q = torch.randint(0, 16, (128, 192), generator=gen, dtype=torch.int32)
    words = pack_mma(q)
    assert words.shape == (3, 1024) and words.dtype == torch.int32
    # block 2, chunk 1, tile 2, lane 5 (g = 1, t = 1), MMA i = 3: rows n0 = 128 + 32 + 1, n1 = n0 + 8;
    # K positions p = 64 + 16 + 12 .. + 3; the word's nibbles (bit: value) per the module docstring
    n0, p = 161, 92
    want = {0: q[p, n0], 16: q[p + 1, n0], 4: q[p, n0 + 8], 20: q[p + 1, n0 + 8],
            8: q[p + 2, n0], 24: q[p + 3, n0], 12: q[p + 2, n0 + 8], 28: q[p + 3, n0 + 8]}
    w = int(words[2, 512 * 1 + 128 * 2 + 4 * 5 + 3]) & 0xFFFFFFFF
    for bit, v in want.items():
        assert (w >> bit) & 15 == int(v), f"seed {gen.initial_seed()}: bit {bit}"
    assert torch.equal(unpack_mma(words), q)


def test_groups_round_trip(gen):
    s = torch.rand(3, 128, generator=gen).half()
    z = torch.randint(0, 16, (3, 128), generator=gen)
    for scales in (s, s.float(), s.bfloat16().float()):  # any dtype, as long as fp16 holds the values
        ps, pz = pack_mma_groups(scales, z)
        assert ps.dtype == torch.float16 and pz.dtype == torch.int32 and ps.shape == (3, 2, 8, 8) \
            and pz.shape == (3, 2, 8, 2)
        # entry [grp, nb, g, 2T + r] is row 64 nb + 16 T + 8 r + g; its zero point at bits
        # 8 (T & 1) + 4 r of both halves of word [grp, nb, g, T >> 1]
        for t_, r in ((1, 1), (2, 0), (3, 1)):
            row = 64 + 16 * t_ + 8 * r + 3
            assert ps[2, 1, 3, 2 * t_ + r] == scales[2, row]
            word = int(pz[2, 1, 3, t_ >> 1]) & 0xFFFFFFFF
            for half in (0, 16):
                assert (word >> (half + 8 * (t_ & 1) + 4 * r)) & 15 == int(z[2, row])
        s2, z2 = unpack_mma_groups(ps, pz)
        assert torch.equal(s2, scales.float()) and torch.equal(z2, z.int())


def test_groups_refuse_what_the_layout_cannot_hold(gen):
    z = torch.randint(0, 16, (2, 64), generator=gen)
    s = torch.rand(2, 64, generator=gen).half().float()
    s[1, 7] += 1e-5  # not a float16 value: fp16 would change it
    with pytest.raises(ValueError, match="not all exact in float16"):
        pack_mma_groups(s, z)
    with pytest.raises(ValueError, match="not all exact in float16"):
        pack_mma_groups(torch.full((2, 64), 70000.0), z)  # past fp16's range
    z[0, 3] = 16  # a GPTQ v1 zero point of 0 (stored 15, plus 1)
    with pytest.raises(ValueError, match=r"not all 4-bit, in \[0, 16\)"):
        pack_mma_groups(s.half(), z)


def _emulate(x, words, scales, zeros, group):
    """y [M, N] fp32 as the kernel computes it, one m16n8k16 MMA at a time, with the A/B
    fragments placed as the PTX ISA specifies (lane = 4g + t; A regs 0-3: (g, 2t..), (g+8, 2t..),
    (g, 2t+8..), (g+8, 2t+8..); B regs 0-1: (2t.., g), (2t+8.., g)) and the kernel's K
    permutation (MMA i of a chunk, logical K 2t + 8r + h <-> chunk position 16t + 4i + 2r + h)."""
    m, k = x.shape
    nblk = words.shape[0]
    s, z = unpack_mma_groups(scales, zeros)
    y = torch.zeros(m, nblk * 64)
    w = words.to(torch.int64) & 0xFFFFFFFF
    for nb in range(nblk):
        for c in range(k // 64):
            grp = c * 64 // group
            for T in range(4):
                for i in range(4):
                    a = torch.zeros(16, 16)
                    b = torch.zeros(16, 8)
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        word = int(w[nb, c * 512 + T * 128 + lane * 4 + i])
                        for j in range(4):  # A register j: (row, first col)
                            row, col = g + 8 * (j & 1), 2 * t + 8 * (j >> 1)
                            n = nb * 64 + T * 16 + row
                            for h in range(2):
                                a[row, col + h] = ((word >> (4 * j + 16 * h)) & 15) - z[grp, n]
                        for r in range(2):  # B register r: K rows 2t + 8r + h, column (token) g
                            for h in range(2):
                                if g < m:
                                    b[2 * t + 8 * r + h, g] = x[g, c * 64 + 16 * t + 4 * i + 2 * r + h]
                    rows = nb * 64 + T * 16 + torch.arange(16)
                    d = a @ b  # [16 rows, 8 tokens]
                    y[:, rows] += (d * s[grp, rows][:, None]).t()[:m]
    return y


def test_fragment_emulation_matches_reference(gen):
    k, n, group, m = 128, 64, 64, 3
    q, s, z, w_ref = _quant(k, n, group, gen)
    ps, pz = pack_mma_groups(s, z)
    x = torch.randn(m, k, generator=gen)
    y = _emulate(x, pack_mma(q), ps, pz, group)
    ref = x @ w_ref
    err = ((y - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-5, f"seed {gen.initial_seed()}: {err}"
    # the reference the reference path uses agrees too
    assert torch.allclose(dequantize_mma(pack_mma(q), ps, pz, group_size=group, dtype=torch.float32), w_ref)


def test_blockers():
    assert mma_blocker(4096, 4096, 128, torch.bfloat16) is None
    assert "group_size 32" in mma_blocker(4096, 4096, 32, torch.float16)
    assert "out features 4104" in mma_blocker(4096, 4104, 128, torch.float16)
    assert "float32" in mma_blocker(4096, 4096, 128, torch.float32)
    assert "CUDA" in w4_mma.runtime_blocker(torch.device("cpu"))


def _layer(layout, backend, group=128, k=256, n=192, dtype=torch.float16, device="cpu", gen=None):
    from kvforge.layers.linear import FusedLinear
    from kvforge_plugins.quant.awq import AWQConfig, AWQSettings
    from kvforge_plugins.quant.common import pack_rows
    qc = AWQConfig({"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"},
                   AWQSettings(backend=backend, int4_layout=layout))
    q, s, z, w_ref = _quant(k, n, group, gen)
    order = torch.arange(n).view(-1, 8)[:, [0, 2, 4, 6, 1, 3, 5, 7]].reshape(-1)  # AutoAWQ's nibble order
    with torch.device(device):
        layer = FusedLinear(k, [n], False, qc, "model.layers.0.mlp.down_proj", dtype)
    layer.load("qweight", pack_rows(q[:, order].t().contiguous(), 4).t().contiguous().to(device), None)
    layer.load("qzeros", pack_rows(z[:, order].t().contiguous(), 4).t().contiguous().to(device), None)
    layer.load("scales", s.half().to(device), None)
    return layer, (q - z[torch.arange(k) // group]).float() * s.half().float()[torch.arange(k) // group]


def test_layout_refusals_on_cpu(gen):
    # the kernel path on a CPU (Triton interpreter backend): no CUDA, refused with the reason
    layer, _ = _layer("mma", "triton", gen=gen)
    with pytest.raises(ValueError, match="down_proj: int4_layout 'mma' does not apply: needs a CUDA device"):
        layer.method.process_weights_after_loading(layer)
    layer, _ = _layer("mma", "reference", group=32, gen=gen)
    with pytest.raises(ValueError, match="group_size 32 is not a multiple of 64"):
        layer.method.process_weights_after_loading(layer)
    # the reference path holds the checkpoint's packing whatever the layout asked for
    layer, w_ref = _layer("mma", "reference", gen=gen)
    layer.method.process_weights_after_loading(layer)
    assert layer.wna16_layout == "checkpoint"


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

#: launch configs the GPU test runs beside the defaults (tests/test_cuda_sources_compile.py
#: compiles each of them on the CPU too, so a broken #if branch shows up before device time)
GPU_CONFIGS = [dict(split_k=1), dict(WARPS=1, TW=1, S=3, XS=1), dict(WARPS=2, TW=2, SCALE_A=True, XS=1),
               dict(TW=4, S=1, waves=1), dict(XS=1, MINB=2), dict(TW=4, WARPS=4, CPA=4, LDW=1),
               dict(TW=1, WARPS=8, CPA=3, XS=1, SCALE_A=True), dict(TW=2, WARPS=2, CPA=8, split_k=1),
               # K split by the warps of a CTA (KW), alone and beside split K
               dict(TW=2, WARPS=8, KW=4, S=2), dict(TW=1, WARPS=16, KW=16, CPA=3, XS=1, split_k=1),
               dict(TW=4, WARPS=4, KW=2, SCALE_A=True, split_k=2),
               # x through the CTA's ring (XR), alone, with KW shares and split K
               dict(TW=2, WARPS=8, CPA=4, XR=1, SCALE_A=True), dict(TW=2, WARPS=4, KW=2, CPA=3, XR=1, split_k=2),
               dict(TW=1, WARPS=8, CPA=2, XR=1, SCALE_A=False),
               # warpgroup MMAs (WG; sm_90a, elsewhere the same tiles on mma.sync), alone and with split K
               dict(TW=1, WARPS=4, CPA=4, XR=1, WG=1, SCALE_A=True),
               dict(TW=1, WARPS=8, CPA=3, XR=1, WG=1, SCALE_A=True, split_k=2),
               # WG 2: a producer warp's bulk copies through mbarrier-guarded stages (dead warpgroups)
               dict(TW=1, WARPS=16, CPA=4, XR=1, WG=2, SCALE_A=True),
               dict(TW=1, WARPS=4, CPA=8, XR=1, WG=2, SCALE_A=True, split_k=2),
               # WG 2's consumers in trips of CPA chunks (WST): with a pair of chunks after the
               # trips, at 4 CTAs per SM (96 registers), a cluster sum; and CPA 6 (group 256: the
               # usual loop). The table's WST + MINB 4 + cluster rows run in w4_table_check.py
               dict(TW=1, WARPS=4, CPA=4, XR=1, WG=2, SCALE_A=True, split_k=1, WST=1, MINB=4),
               dict(TW=1, WARPS=4, CPA=4, XR=1, WG=2, SCALE_A=True, split_k=2, CLU=1, WST=1),
               dict(TW=1, WARPS=8, CPA=6, XR=1, WG=2, SCALE_A=True, WST=1),
               # split K summed inside a thread block cluster (CLU): WG 2, WG, and KW sums first
               dict(TW=1, WARPS=4, CPA=8, XR=1, WG=2, SCALE_A=True, split_k=2, CLU=1),
               dict(TW=1, WARPS=8, CPA=3, XR=1, WG=1, SCALE_A=True, split_k=3, CLU=1),
               dict(TW=4, WARPS=4, KW=2, SCALE_A=True, split_k=3, CLU=1),
               # chunk addresses from per-warp bases (CUR): S dividing the group's chunks or not (the
               # bounds tests kept), x in shared memory, split K through global memory and a cluster
               dict(TW=1, WARPS=16, KW=16, S=2, CUR=1), dict(TW=1, WARPS=8, KW=8, S=1, CUR=1),
               dict(TW=2, WARPS=4, S=3, XS=1, CUR=1, split_k=2),
               dict(TW=4, WARPS=4, KW=2, S=4, CUR=1, split_k=3, CLU=1)]


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
# (576, 256, 64): 9 chunks, so WG 2 with split_k 2 runs an odd count (its peeled first step) of 5
@pytest.mark.parametrize("k,n,group", [(1024, 2048, 128), (512, 192, 64), (768, 320, 256), (1024, 256, 1024),
                                       (576, 256, 64)])
def test_gpu_kernel(dtype, k, n, group, gen):
    if w4_mma.runtime_blocker(torch.device("cuda")):
        pytest.skip(w4_mma.runtime_blocker(torch.device("cuda")))
    for m, cfg, err, same in gpu_kernel_cases(k, n, group, dtype, [None] + GPU_CONFIGS,
                                              (1, 3, 8, 9, 16, 17, 33, 64, 65, 130), gen):
        assert err <= BOUND[dtype], f"seed {gen.initial_seed()} M={m} {cfg}: {err}"
        assert same, f"M={m} {cfg}: not deterministic"


def gpu_kernel_cases(k, n, group, dtype, configs, ms, gen):
    """Each (M, config) on the GPU against the fp32 reference of fresh random weights: yields
    (M, config, relative max error, whether a second run gave the same bits: the split-K
    counters were reset). Past MAX_FUSED_M only the default (dequantize) path runs.
    ``benchmarks/w4_ring_check.py`` runs it with a few configs."""
    q, s, z, w_ref = _quant(k, n, group, gen)
    ps, pz = pack_mma_groups(s, z)
    words, ps, pz, w_ref = pack_mma(q).cuda(), ps.cuda(), pz.cuda(), w_ref.cuda()
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        ref = x.float() @ w_ref
        for cfg in configs if m <= w4_mma.MAX_FUSED_M else [None]:
            y = w4_mma.mma_gemm(x, words, ps, pz, group_size=group, n=n, config=cfg)
            y2 = w4_mma.mma_gemm(x, words, ps, pz, group_size=group, n=n, config=cfg)
            yield m, cfg, ((y.float() - ref).abs().max() / ref.abs().max()).item(), torch.equal(y, y2)


@cuda
def test_gpu_kernel_in_cuda_graph(gen):
    if w4_mma.runtime_blocker(torch.device("cuda")):
        pytest.skip(w4_mma.runtime_blocker(torch.device("cuda")))
    k, n, group = 2048, 1024, 128
    q, s, z, w_ref = _quant(k, n, group, gen)
    ps, pz = pack_mma_groups(s, z)
    words, ps, pz = pack_mma(q).cuda(), ps.cuda(), pz.cuda()
    x = torch.randn(4, k, device="cuda", dtype=torch.bfloat16)
    eager = w4_mma.mma_gemm(x, words, ps, pz, group_size=group, n=n)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w4_mma.mma_gemm(x, words, ps, pz, group_size=group, n=n)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(out, w4_mma.mma_gemm(x, words, ps, pz, group_size=group, n=n))
    assert not torch.equal(out, eager)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_layer_mma_layout(dtype, gen):
    if w4_mma.runtime_blocker(torch.device("cuda")):
        pytest.skip(w4_mma.runtime_blocker(torch.device("cuda")))
    layer, w_ref = _layer("mma", "auto", dtype=dtype, device="cuda", gen=gen)
    layer.method.process_weights_after_loading(layer)
    assert layer.wna16_layout == "mma" and layer.qweight.shape == (3, 256 * 8)
    for m in (1, 7, 100):
        x = torch.randn(m, 256, device="cuda", dtype=dtype)
        with torch.inference_mode():
            y = layer(x).float()
        ref = x.float() @ w_ref.cuda()
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        assert err <= BOUND[dtype], f"seed {gen.initial_seed()} M={m}: {err}"


def test_torch_stream_views_are_cached_per_handle(monkeypatch):
    """The NVRTC launch helper shared with flash_decode: one CuPy view per torch stream."""
    import types

    from kvforge.layers.cupy_launch import TorchStreams, ptr
    made = []

    class ExternalStream:
        def __init__(self, handle):
            made.append(handle)

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(ExternalStream=ExternalStream))
    current = {"h": 11}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=current["h"]))
    streams = TorchStreams(fake)
    a = streams.current(torch.device("cuda", 0))
    assert streams.current(torch.device("cuda", 0)) is a and made == [11]
    current["h"] = 12
    assert streams.current(torch.device("cuda", 0)) is not a and made == [11, 12]
    t = torch.zeros(3)
    assert int(ptr(t)) == t.data_ptr()


def test_triton_backend_off_cuda_is_refused_at_load(monkeypatch):
    """``backend: triton`` on a CPU without the Triton interpreter cannot run: refused by the
    quantizer's ``validate`` (before loading), naming the setting and the way out."""
    from kvforge_plugins.quant.awq import AWQConfig, AWQSettings
    from kvforge_plugins.quant.int8 import Int8Config, Int8Settings
    hf = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"}
    cpu = torch.device("cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for cfg in (AWQConfig(hf, AWQSettings(backend="triton")), Int8Config(None, Int8Settings(backend="triton"))):
        (why,) = cfg.validate(torch.float16, cpu)
        assert "quantization.settings.backend 'triton' needs a CUDA device, or TRITON_INTERPRET=1" in why
    assert AWQConfig(hf, AWQSettings(backend="reference")).validate(torch.float16, cpu) == []
    # backend torch (cuBLAS GEMM) quantizes activations with a Triton kernel: refused alike
    from kvforge_plugins.quant.fp8 import FP8Config, FP8Settings
    for cfg in (Int8Config(None, Int8Settings(backend="torch")), FP8Config(None, FP8Settings(backend="torch"))):
        why = cfg.validate(torch.float16, cpu)
        assert any("quantization.settings.backend 'torch' needs a CUDA device" in w for w in why), why
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert AWQConfig(hf, AWQSettings(backend="triton")).validate(torch.float16, cpu) == []


def test_layout_on_reference_backend_warns_once(gen, caplog):
    layer, _ = _layer("mma", "reference", gen=gen)
    method = layer.method
    with caplog.at_level("WARNING", logger="kvforge.quant"):
        method.process_weights_after_loading(layer)
        layer2, _ = _layer("mma", "reference", gen=gen)
        layer2.method = method  # a second layer of the same quantizer
        method.process_weights_after_loading(layer2)
    hits = [r for r in caplog.records if "has no effect on the reference backend" in r.getMessage()]
    assert len(hits) == 1 and layer.wna16_layout == layer2.wna16_layout == "checkpoint"


def test_device_facts_are_asked_once_per_device(monkeypatch):
    """The eager decode path calls the GEMM ~100 times a step: the device's capability and
    shared-memory limit are read once per device, not per call."""
    from types import SimpleNamespace
    calls = []

    def props(index):
        calls.append(index)
        return SimpleNamespace(major=9, minor=0 if index == 0 else 1, shared_memory_per_block_optin=232448)

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    w4_mma._device_facts.cache_clear()
    try:
        for _ in range(3):
            assert w4_mma.wgmma_capable(torch.device("cuda", 0))
            assert w4_mma._smem_limit(torch.device("cuda", 0)) == 232448 - 2048
            assert not w4_mma.wgmma_capable(torch.device("cuda", 1))
        assert calls == [0, 1]
    finally:
        w4_mma._device_facts.cache_clear()  # the fake's answers must not outlive the test
