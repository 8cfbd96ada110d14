"""Weight-only int4/int8 GEMM (W4A16 / W8A16): ``y = x @ dequant(W)``, AutoAWQ and GPTQ
packed layouts. This module: API, configs, dispatch; kernels in ``wna16_kernels.py`` (whole
kernels) and ``wna16_tiles.py`` (per-tile pieces).

Shapes and dtypes (K = in features, N = out features, pf = 32 // bits values per int32,
value i of a word in bits [i*bits, (i+1)*bits)):

* ``x`` [M, K] fp16 / bf16 / fp32 -> ``y`` [M, N] in ``x.dtype`` (fp32 accumulation).
* ``pack_k=False`` (AutoAWQ GEMM; "N-packed"): ``qweight`` int32 [K, N/pf]; with ``awq_order``
  nibble i of word c holds column ``8c + (0,2,4,6,1,3,5,7)[i]`` (AutoAWQ's order), else
  ``pf*c + i``. ``pack_k=True`` (GPTQ; "K-packed"): int32 [K/pf, N], field i of word r is row
  ``pf*r + i``.
* ``scales`` [G, N] fp16/bf16/fp32 and ``zeros`` [G, N] uint8 already unpacked (true zero
  points, any GPTQ v1 ``-1`` offset removed by the caller); G = ceil(K / group), row k uses
  group ``k // group_size`` (``group_size = K``: per channel).
  ``w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]``. Act-order (GPTQ ``desc_act``) is
  handled by the caller: rows permuted at load time so groups are contiguous, ``x`` gathered.

Decode (M < ``PREFILL_MIN_M``): one fused kernel. Reading the packed weight is the floor (an
int4 4096x4096 layer is 8 MB, ~2 us on an H200), and at that rate the instruction count per
weight decides (an H200 issues ~30e12 thread-instructions/s: 5 per weight of a 14336x14336
layer take ~35 us, more than its 103 MB take to read). So the kernel never reshapes packed
words into a [K, N] tile (a shared-memory layout conversion per tile); the dequantization
core is 2-3 instructions per weight; with loads, scales and addressing the compiled sm90
loops of the default configs count ~4.5 per weight at M = 1 and 16 (GPTQ 4.3 / 5.5) and
7.7 at M = 64 (GPTQ 5.5) (Triton 3.6 and 3.9, ``cuobjdump -sass``). Timed on the H200 they
reach only ~1.6 TB/s of packed weight at M = 1-16 (14336x14336; BENCHMARKS.md), half the copy
rate, and the CUDA-core path below is slower than the MMA path even at M = 1:

* Fields are extracted in the loaded layout by a ``tl.static_range`` loop over the pf fields
  of the word tile. Int -> float without the slow I2F unit: the field, masked in place, is
  OR-ed into the mantissa of fp32 2**23 and ``2**23 + z`` is subtracted (exact); fields of the
  high half come from ``w >> 16`` (one shift per word), their power-of-two offset is folded
  into zero point and scale. One LOP3 + one FADD per weight.
* AWQ: field j is the output columns ``pf*c + j``: one accumulator per field (a tuple),
  joined along a new in-thread dimension (tl.join: no data movement) and reshaped into
  natural column order once, at the end. GPTQ: field i is the input rows ``pf*r + i``: it
  multiplies the stride-pf gather ``x[:, pf*r + i]``; one accumulator.
* ``dot=False`` (MODE 0; the N-packed M = 1 default until the H200 timed it slower than
  ``swap_ab``): CUDA cores. Word tiles [num_warps, BLOCK_N/pf] (a row per warp, columns over lanes) keep the sum over k inside each thread (FFMA chains; the warps are
  summed once at the end); a tile lies in one group, so its scale multiplies the tile's
  partial sums, not each weight (LOP3 + FADD + FFMA per weight). ``prefetch``: the next
  tile's loads are issued before this tile's math (the compiler otherwise schedules loads a
  row or two ahead of their use).
* ``dot=True``: ``tl.dot`` per field; ``swap_ab`` computes ``W^T x^T`` so that the weight is
  the MMA's M side (Hopper wgmma reads it from registers; the few tokens are its N side);
  ``scale_after`` (tile inside one group): the MMA gets the exact integers ``(q - z) * 2**E``
  and the group scale multiplies its [.., BLOCK_M] product. ``joined``: the fields are joined
  into the natural [BLOCK_K, BLOCK_N] tile and one MMA per tile updates one [BLOCK_M, BLOCK_N]
  accumulator (larger M: per-field MMAs are narrow). Each tl.dot side must be >= 16.
* Split-K fills the SMs (``split_k``, else ``min(max_split, waves * SMs / tiles)``).
  ``reduce="serial"``: partials go to an fp32 workspace and the last program of a tile to
  arrive (a per-tile counter that it resets) sums them in split order: ONE launch (under CUDA
  graphs a memset or cast launch costs ~2-3 us, about the time of a 4096x4096 int4 read).
  ``"atomic"``: atomic adds into a zeroed output in x.dtype (bf16 needs sm90; else fp32);
  ``"atomic_fp32"``: into an fp32 buffer, then a cast.

Prefill (M >= ``PREFILL_MIN_M``, ``path="dequant"``): a Triton kernel dequantizes W into a
[K, N] temporary in x.dtype (in registers, written once in full rows; never cached: int4 is
about memory), then cuBLAS multiplies -- as vLLM does for AWQ from 256 tokens; there the
GEMM is compute-bound and a fused kernel's per-tile dequantization costs more than one pass
over W. Any config may set ``path`` (the tuner may pick ``fused`` for mid-size M).

Configs: ``DEFAULTS`` <- ``CONFIGS[bucket(M, pack_k)]`` <- the tuned table for this GPU and
shape (``choices.py``; kind "wna16" for N-packed weights, "wna16_kpack" for K-packed;
written by ``benchmarks/bench_quant.py --tune``) <- ``config=``. The serial reduction's tile
counters come from :func:`kvforge.layers.arrival_counters.arrival_counters` (one zeroed
buffer per device: launches on one device must not run concurrently on several streams).
"""
from __future__ import annotations

import functools
import logging
import math

import torch

from kvforge.layers.arrival_counters import arrival_counters

from .choices import lookup
from .wna16_kernels import kernels

log = logging.getLogger("kvforge")

#: fp32 bits of 2**23, a run-time kernel argument on purpose (see ``wna16_tiles._qf``).
_MAGIC = 0x4B000000
#: M at and above which the dequantize + cuBLAS path runs by default.
PREFILL_MIN_M = 65

#: Tuned-table entries carry ``"schema": TABLE_SCHEMA``; others (older kernels) are ignored.
TABLE_SCHEMA = 2
#: Every config key with its default (see the module docstring for what they do).
DEFAULTS = dict(path="fused", dot=True, swap_ab=False, joined=False, scale_after=True, prefetch=True,
                BLOCK_M=16, BLOCK_N=256, BLOCK_K=128, num_warps=4, num_stages=3,
                split_k=None, max_split=16, waves=2, reduce="serial")
#: Per bucket; "_kpack": K-packed (GPTQ) weights. Chosen from the compiled sm90 code (registers,
#: no spills, instructions per weight); ``benchmarks/bench_quant.py --tune`` measures.
CONFIGS: dict[str, dict] = {
    # M = 1 on N-packed weights: the M = 16 MMA tile (15 rows masked) measured 1.5-2.3x faster
    # than the CUDA-core GEMV on the H200 (bench_quant.py --tune, BENCHMARKS.md).
    "decode1": dict(swap_ab=True, BLOCK_M=16, BLOCK_N=512, BLOCK_K=64, num_warps=4),
    "decode16": dict(swap_ab=True, BLOCK_M=16, BLOCK_N=512, BLOCK_K=64, num_warps=4),
    "decode64": dict(joined=True, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, max_split=4),
    "prefill": dict(path="dequant", BLOCK_N=256, BLOCK_K=64, num_warps=4),
    "decode1_kpack": dict(dot=False, BLOCK_N=256, BLOCK_K=128, num_warps=4),
    "decode16_kpack": dict(swap_ab=True, BLOCK_M=16, BLOCK_N=256, BLOCK_K=128, num_warps=4),
    "decode64_kpack": dict(joined=True, BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_warps=4, max_split=4),
}


def bucket(m: int, pack_k: bool = False) -> str:
    name = "decode1" if m == 1 else "decode16" if m <= 16 else "decode64" if m < PREFILL_MIN_M else "prefill"
    return name + "_kpack" if pack_k and name + "_kpack" in CONFIGS else name


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def _config(m: int, n: int, k: int, x: torch.Tensor, pack_k: bool, config: "dict | None") -> dict:
    if config is None and x.is_cuda:
        tuned = lookup("wna16_kpack" if pack_k else "wna16", m, n, k, x.device) or {}
        if tuned.get("schema") != TABLE_SCHEMA:  # an entry tuned for an older kernel
            tuned = {}
        config = {key: v for key, v in tuned.items() if key in DEFAULTS}
    elif config is not None and set(config) - set(DEFAULTS):
        raise ValueError(f"wna16: unknown config keys {sorted(set(config) - set(DEFAULTS))}")
    return {**DEFAULTS, **CONFIGS[bucket(m, pack_k)], **(config or {})}


def wna16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, *,
               bits: int, group_size: int, pack_k: bool, awq_order: bool, n: int,
               config: "dict | None" = None) -> torch.Tensor:
    """Triton weight-only GEMM. ``x`` [M, K] fp16/bf16/fp32 -> [M, N] in ``x.dtype``.

    ``qweight``/``scales``/``zeros`` as in the module docstring; ``group_size`` = K for
    per-channel. ``config`` overrides the launch config (keys: ``DEFAULTS``). A config Triton
    refuses for shared memory (fp32 activations on tiles tuned for 16-bit ones; a GPU with less
    shared memory than the one tuned on) is shrunk step by step (``_smaller``) and the one that
    runs is remembered for the shape; ``triton.runtime.errors.OutOfResources`` when none fits.
    """
    assert bits in (4, 8) and (not awq_order or bits == 4)
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    if m == 0:
        return x.new_empty((0, n))
    pf = 32 // bits
    assert (k if pack_k else n) % pf == 0, "the packed dimension must be a multiple of 32 // bits"
    cfg = _config(m, n, k, x, pack_k, config)
    key = None  # (built only where a config was ever refused: this runs for every layer of every step)
    if _FITTED:
        key = _fit_key(cfg, x, bits, pack_k, group_size, n, k)
        cfg = _FITTED.get(key, cfg)
    while True:
        try:
            return _run(x, qweight, scales, zeros, bits, group_size, pack_k, awq_order, n, cfg)
        except _out_of_resources() as e:  # e.g. fp32 activations: twice the shared memory of the tuned tiles
            if key is None:
                key = _fit_key(cfg, x, bits, pack_k, group_size, n, k)  # (cfg: still the requested one)
            smaller = _smaller(cfg, bits, group_size, pack_k, k)
            if smaller is None:
                raise
            log.info("wna16: config %s does not fit this GPU (%s); trying %s", cfg, str(e).split(".")[0], smaller)
            _FITTED[key] = cfg = smaller


#: Configs shrunk to fit a device's shared memory, by (requested config, dtype, device, layout, shape).
_FITTED: dict = {}


def _fit_key(cfg: dict, x: torch.Tensor, bits: int, pack_k: bool, group_size: int, n: int, k: int) -> tuple:
    return tuple(cfg.items()), x.dtype, x.device, bits, pack_k, group_size, n, k


def _out_of_resources() -> tuple:
    try:
        from triton.runtime.errors import OutOfResources
    except ImportError:
        return ()
    return (OutOfResources,)


def _smaller(cfg: dict, bits: int, group: int, pack_k: bool, k: int) -> "dict | None":
    """The next config to try when Triton refuses ``cfg`` for shared memory: one pipeline stage
    fewer, then half the BLOCK_N, then half the BLOCK_K (each as long as ``_mode`` accepts the
    tile); None when nothing smaller is left."""
    steps = ([{"num_stages": cfg["num_stages"] - 1}] if cfg["num_stages"] > 1 else []) + \
        ([{"BLOCK_N": cfg["BLOCK_N"] // 2}] if cfg["BLOCK_N"] > 16 else []) + \
        ([{"BLOCK_K": cfg["BLOCK_K"] // 2}] if cfg["BLOCK_K"] > 16 else [])
    for step in steps:
        cand = {**cfg, **step}
        try:
            _mode(cand, bits, group, pack_k, k)
        except ValueError:  # a tl.dot side under 16
            continue
        return cand
    return None


def _run(x, qweight, scales, zeros, bits, group_size, pack_k, awq_order, n, cfg) -> torch.Tensor:
    """One launch of the fused (or dequantize + matmul) path with the full config ``cfg``."""
    m, k = x.shape
    pf = 32 // bits
    bn = cfg["BLOCK_N"]
    ks = kernels()
    fused, dequant = ks["_fused_kernel"], ks["_dequant_kernel"]
    if cfg["path"] == "dequant":
        bk = cfg["BLOCK_K"]
        assert (bk if pack_k else bn) % pf == 0, f"the packed tile side must be a multiple of {pf}"
        w = torch.empty((k, n), dtype=x.dtype, device=x.device)
        dequant[(-(-k // bk), -(-n // bn))](
            qweight, scales, zeros, _MAGIC, w, n, n // pf, k, BITS=bits, PACK_K=pack_k, AWQ_ORDER=awq_order,
            GROUP=group_size, ROW_SCALES=group_size % bk == 0 or group_size >= k, BLOCK_K=bk, BLOCK_N=bn,
            num_warps=cfg["num_warps"])
        return x @ w

    mode, bm, bk, swap = _mode(cfg, bits, group_size, pack_k, k)
    assert (bk if pack_k else bn) % pf == 0, f"the packed tile side must be a multiple of {pf}"
    warps = cfg["num_warps"]
    if mode == 0:  # a word row per warp and step: the tile's word rows must split evenly
        warps = math.gcd(warps, bk // pf if pack_k else bk)
    tiles = -(-m // bm) * -(-n // bn)
    k_tiles = -(-k // bk)
    split = cfg["split_k"]
    if not split:
        sms = _num_sms(x.device.index or 0) if x.is_cuda else 4
        split = max(1, min(cfg["max_split"], k_tiles, cfg["waves"] * sms // tiles))
    per_split = -(-k_tiles // split)
    split = -(-k_tiles // per_split)  # no empty splits
    serial = split > 1 and cfg["reduce"] == "serial"
    ws = cnt = None
    if split == 1 or serial:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        if serial:
            assert split * m * n < 2 ** 31
            ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
            cnt = arrival_counters(tiles, x.device)
    else:
        assert cfg["reduce"] in ("atomic", "atomic_fp32"), cfg["reduce"]
        fp32 = cfg["reduce"] == "atomic_fp32" or (x.dtype == torch.bfloat16 and x.is_cuda
                                                  and not _sm90(x.device.index or 0))
        out = torch.zeros((m, n), dtype=torch.float32 if fp32 else x.dtype, device=x.device)
    fused[(tiles, split)](
        x, qweight, scales, zeros, _MAGIC, out, out if ws is None else ws, out if cnt is None else cnt, m, n, n // pf,
        k, x.stride(0), out.stride(0), per_split, BITS=bits, PACK_K=pack_k, AWQ_ORDER=awq_order, GROUP=group_size,
        ROW_SCALES=mode == 0 or group_size % bk == 0 or group_size >= k, EVEN_K=k % bk == 0, BLOCK_M=bm,
        BLOCK_N=bn, BLOCK_K=bk, MODE=mode, SWAP=swap, PREFETCH=bool(cfg["prefetch"]), RW=warps,
        WSTRIDE=(n if pack_k else n // pf) if mode == 0 else 0, SPLIT_K=split, SERIAL=serial,
        FP32_DOT=x.dtype == torch.float32, num_warps=warps, num_stages=cfg["num_stages"])
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _mode(cfg: dict, bits: int, group: int, pack_k: bool, k: int) -> tuple[int, int, int, bool]:
    """(MODE, BLOCK_M, BLOCK_K, SWAP) of the fused kernel for a config and weight; MODE 0: CUDA
    cores, 1: per-field tl.dot, 2: per-field tl.dot with the scale after, 3: joined tl.dot."""
    pf = 32 // bits
    bk, dot = cfg["BLOCK_K"], cfg["dot"]
    row = group % bk == 0 or group >= k
    if not dot and not row:  # MODE 0 needs a tile inside one group; it unrolls rows (any BLOCK_K)
        bk = math.gcd(bk, group)
        if pack_k and bk % pf:  # a packed word spans groups: only tl.dot's per-row scales
            return _mode({**cfg, "dot": True, "BLOCK_M": 16, "BLOCK_K": 16 * pf}, bits, group, pack_k, k)
        row = True
    if not dot:
        return 0, 1, bk, False
    bm, bn, joined = cfg["BLOCK_M"], cfg["BLOCK_N"], bool(cfg["joined"])
    min_bk = 16 * pf if pack_k and not joined else 16  # per-field MMAs: K side BLOCK_K / pf (K-packed)
    if not row and group < bk and bk % group == 0 and group >= min_bk:
        bk, row = group, True  # a tile inside one group: one scale row per tile
    if bm < 16 or bk < min_bk or (bn // pf if not (pack_k or joined) else bn) < 16:
        raise ValueError(f"wna16: tl.dot needs sides >= 16 (BLOCK_M; per-field MMAs: BLOCK_N / {pf} N-packed, "
                         f"BLOCK_K / {pf} K-packed): config {cfg}, bits {bits}")
    if joined:
        return 3, bm, bk, False
    return (2 if cfg["scale_after"] and row else 1), bm, bk, bool(cfg["swap_ab"])


def dequantize_wna16(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, *, bits: int,
                     group_size: int, pack_k: bool, awq_order: bool, dtype: torch.dtype,
                     g_idx: "torch.Tensor | None" = None) -> torch.Tensor:
    """Reference dequantization -> W^T [K, N] in ``dtype`` (computed in fp32).

    ``g_idx`` [K] (GPTQ act-order): row k uses group ``g_idx[k]`` instead of ``k // group_size``.
    """
    from ..common import unpack_cols, unpack_rows
    q = unpack_rows(qweight, bits) if pack_k else unpack_cols(qweight, bits, awq_order)
    return dequantize_groups(q, scales, zeros, group_size, dtype, g_idx)


def dequantize_groups(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                      dtype: torch.dtype, g_idx: "torch.Tensor | None" = None) -> torch.Tensor:
    """Unpacked ints ``q`` [K, N] -> ``(q - zeros[g]) * scales[g]`` [K, N] in ``dtype`` (fp32
    math); row k uses group ``g_idx[k]`` if given, else ``k // group_size``."""
    g = g_idx.long() if g_idx is not None else torch.arange(q.shape[0], device=q.device) // group_size
    return ((q.float() - zeros.float()[g]) * scales.float()[g]).to(dtype)
