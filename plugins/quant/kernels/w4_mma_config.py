"""Launch configs of the int4 mma GEMM (``w4_mma.cu``): the checks a caller's config must pass
before it is compiled in, and the shared memory each option takes (the x copy, the cp.async
stages, the XR ring, the KW sums). Pure functions of the config; ``w4_mma`` re-exports them."""
from __future__ import annotations

#: Above this M the dequantize + cuBLAS path runs (the fused kernel keeps 8 * NB tokens per warp).
MAX_FUSED_M = 64


def x_bytes(cfg: dict, m: int, k: int, cps: int, esize: int) -> int:
    """Shared memory of the x copy: XS, M rows of the split's ``cps`` chunks (+16 bytes of
    pitch); NORM, M whole rows of K (each CTA normalizes them); 0 without XS."""
    if not cfg["XS"]:
        return 0
    return m * ((k if cfg.get("NORM") else cps * 64) + 8) * esize


#: Launch-config keys: the kernel's compile-time constants (GCC is set per call) and the split rule.
CONFIG_KEYS = ("NB", "TW", "WARPS", "S", "XS", "SCALE_A", "MINB", "LDW", "CPA", "KW", "XR", "WG", "CLU", "CUR",
               "WST", "waves", "split_k")


def check_config_keys(cfg: dict) -> None:
    """Raise ValueError for a key that is not a launch-config key, or a value that is not an
    integer (``waves`` may be a float): compile-time constants must not be truncated silently."""
    if not isinstance(cfg, dict):
        raise ValueError(f"w4 mma GEMM: config must be a dict, got {type(cfg).__name__}")
    unknown = sorted(set(cfg) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"w4 mma GEMM: unknown config keys {unknown} (known: {', '.join(CONFIG_KEYS)})")
    bad = sorted(key for key, v in cfg.items() if not (
        isinstance(v, int) or (key == "waves" and isinstance(v, float))
        or (key == "split_k" and v is None)))
    if bad:
        raise ValueError(f"w4 mma GEMM: config {cfg}: {bad} must be integers (split_k may be None)")


def check_config(cfg: dict, m: int) -> None:
    """Raise ValueError unless the full config ``cfg`` launches and its tiles cover M tokens:
    M <= 8 * NB <= MAX_FUSED_M, TW in 1/2/4, 1 <= WARPS <= 32 (1024 threads), S >= 1, XS /
    SCALE_A / LDW / XR 0 or 1, MINB >= 1, CPA 0 or 2..8, KW >= 1 dividing WARPS, split_k >= 0 (0 /
    None: by ``waves``), CLU 0 or 1 (1: 2..8 splits reduce in a thread block cluster, more
    splits through global memory), CUR 0 or 1 (1: the register path's chunk addresses from per-warp
    bases; needs CPA 0); XR needs CPA and excludes XS; WG (1, or 2: with a producer warp) needs
    XR, TW 1, KW 1, WARPS a multiple of 4, SCALE_A, NB in 1, 2, 4, 8 (wgmma's N = 8 * NB) and
    CPA >= 3; WG 2 adds a producer warp, so WARPS <= 28 there. WST 0 or 1 (1: WG 2's consumers
    in trips of CPA chunks) needs WG 2 and an even CPA; a call whose group's chunks do not divide
    CPA (or groups over 512), or whose split holds an odd chunk count, runs the usual loop."""
    check_config_keys(cfg)
    flags = all(int(cfg.get(key, 0)) in (0, 1) for key in ("XS", "SCALE_A", "LDW", "XR", "CLU", "CUR", "WST")) and cfg.get("WG", 0) in (0, 1, 2)
    if cfg.get("CUR") and cfg.get("CPA"):
        raise ValueError(f"w4 mma GEMM: config {cfg}: CUR (the register path's chunk addresses) needs CPA 0")
    if cfg.get("XR") and (not cfg.get("CPA") or cfg.get("XS")):
        raise ValueError(f"w4 mma GEMM: config {cfg}: XR (the x ring) needs CPA >= 2 (its stages) and XS 0")
    if cfg.get("WG") and not (cfg.get("XR") and cfg["TW"] == 1 and cfg.get("KW", 1) == 1 and cfg["WARPS"] % 4 == 0
                              and cfg.get("SCALE_A") and cfg["NB"] in (1, 2, 4, 8) and cfg["CPA"] >= 3):
        raise ValueError(f"w4 mma GEMM: config {cfg}: WG (warpgroup MMAs) needs XR, TW 1, KW 1, WARPS a multiple "
                         "of 4, SCALE_A, NB in 1, 2, 4, 8 and CPA >= 3 (one chunk's MMAs stay in flight)")
    if cfg.get("WST") and (cfg.get("WG") != 2 or cfg.get("CPA", 0) % 2):
        raise ValueError(f"w4 mma GEMM: config {cfg}: WST (trips of CPA chunks) is a way to run WG 2's consumers: "
                         "it needs WG 2 and an even CPA (its trips alternate two fragment buffers)")
    if cfg.get("WG") == 2 and cfg["WARPS"] > 28:
        raise ValueError(f"w4 mma GEMM: config {cfg}: WG 2 launches WARPS + 1 warps (the producer): WARPS <= 28 "
                         "(1024 threads)")
    if not (m <= 8 * cfg["NB"] <= MAX_FUSED_M and cfg["TW"] in (1, 2, 4) and 1 <= cfg["WARPS"] <= 32
            and cfg["S"] >= 1 and flags and cfg.get("MINB", 1) >= 1 and cfg.get("CPA", 0) in (0, *range(2, 9))
            and cfg.get("KW", 1) >= 1 and cfg["WARPS"] % cfg.get("KW", 1) == 0
            and (cfg.get("split_k") or 0) >= 0 and cfg.get("waves", 1) > 0):
        raise ValueError(f"w4 mma GEMM: config {cfg} does not cover M {m} or cannot launch (needs M <= 8 * NB <= "
                         f"{MAX_FUSED_M}, TW in 1/2/4, 1 <= WARPS <= 32, S >= 1, XS / SCALE_A / LDW 0 or 1, "
                         "MINB >= 1, CPA 0 or 2..8, KW >= 1 dividing WARPS, split_k >= 0, waves > 0, XR / CLU 0 or 1, "
                         "WG 0, 1 or 2, CUR / WST 0 or 1)")


def stage_bytes(cfg: dict) -> int:
    """Shared memory of the cp.async stages (``CPA``; 0 without): per stage and thread, 16-byte
    units for TW weight vectors, 2 * NB x runs (unless XS or XR), the scales and the zero-point words."""
    if not cfg.get("CPA") or cfg.get("WG") == 2:  # (WG 2's stages are the CTA's: xr_bytes)
        return 0
    units = cfg["TW"] + (0 if cfg["XS"] or cfg.get("XR") else 2 * cfg["NB"]) + 2
    return cfg["CPA"] * units * 32 * cfg["WARPS"] * 16


#: Bytes between two x rows in the XR ring: 64 elements + 16, so the lanes of a quarter warp
#: read 16-byte runs from distinct banks (``XR_PITCH`` in w4_mma_stages.cuh).
XR_PITCH = 144


def xr_bytes(cfg: dict) -> int:
    """Shared memory of the XR ring (after the stages): CPA slots x KW shares x 8 * NB rows of
    one 64-wide chunk; with WG, CPA slots of 8 * NB rows x 128 bytes, 1024-byte aligned (1 KB
    of slack) for the 128-byte swizzle; with WG 2, CPA whole stages (:func:`ws_stage_bytes`),
    aligned the same way (0 without XR)."""
    if not cfg.get("XR"):
        return 0
    if cfg.get("WG") == 2:
        return cfg["CPA"] * ws_stage_bytes(cfg) + 1024
    if cfg.get("WG"):
        return cfg["CPA"] * cfg["NB"] * 1024 + 1024
    return cfg["CPA"] * cfg.get("KW", 1) * cfg["NB"] * 8 * XR_PITCH


def ws_stage_bytes(cfg: dict) -> int:
    """One stage of WG 2 (``WS_STAGE`` in w4_wgmma_ws.cuh): x's slot (8 * NB rows x 128 bytes),
    2 KB of weight words per 64-row block (WARPS / 4 of them), then 128 bytes of scales and 64
    of zero points per block, rounded up to 1 KB (x's swizzle is anchored on 1024-byte boundaries)."""
    blocks = cfg["WARPS"] // 4
    return -(-(cfg["NB"] * 1024 + blocks * (2048 + 192)) // 1024) * 1024


def reduce_bytes(cfg: dict) -> int:
    """Shared memory where the KW > 1 warps of a column hand their fp32 sums to warp kw = 0:
    (KW - 1) * (WARPS / KW) warps x TW * NB * 4 fragments x 32 lanes x 4 bytes (0 for KW 1)."""
    kw = cfg.get("KW", 1)
    return (kw - 1) * (cfg["WARPS"] // kw) * cfg["TW"] * cfg["NB"] * 4 * 32 * 4


#: Most CTAs in a thread block cluster that every sm_90 GPU schedules (the portable size).
MAX_CLUSTER = 8


def cluster_splits(cfg: dict, splits: int) -> int:
    """The ``CLU`` the kernel is compiled with: the split count when the config asks for the
    cluster reduction (CLU 1) and 2 <= splits <= ``MAX_CLUSTER``, else 0 (global partials)."""
    return splits if cfg.get("CLU") and 2 <= splits <= MAX_CLUSTER else 0


def cluster_bytes(cfg: dict) -> int:
    """Shared memory where a CLU split leaves its fp32 sums for the cluster's rank 0: TW * NB * 4
    fragments x every thread of the CTA x 4 bytes (0 without CLU)."""
    if not cfg.get("CLU"):
        return 0
    return cfg["TW"] * cfg["NB"] * 4 * 32 * (cfg["WARPS"] + (cfg.get("WG") == 2)) * 4
