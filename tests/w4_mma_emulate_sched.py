"""The XR / WG ring schedule of ``w4_mma_gemm`` as the kernel source states it, for the CPU
emulation (tests/w4_mma_emulate.py): the constants are parsed from ``w4_mma_jit.SOURCE`` instead
of being restated here, so an edit to the .cu / .cuh changes what the emulation replays (and its
bounds checks see it), and :func:`check_ring_schedule` proves, for a CPA, that no ring slot is
refilled while a chunk in it may still be read: by an in-flight wgmma group (WG's wait depth)
or before its copies land (the cp.async wait count). WG 2's protocol: w4_mma_emulate_ws.py."""
from __future__ import annotations

import re

from kvforge_plugins.quant.kernels import w4_mma, w4_mma_jit


def _one(pattern: str, text: str, what: str) -> re.Match:
    found = re.findall(pattern, text)
    assert len(found) == 1, f"kernel source: expected one {what} ({pattern!r}), found {len(found)}"
    return re.search(pattern, text)


def kernel_schedule(src: "str | None" = None) -> dict:
    """Parse the ring's constants: XR_PITCH, WG_SBO, each path's prefetch distance as CPA - k,
    the cp.async wait as XR_DIST - k, WG's wgmma wait depth, the slot alignment and swizzle."""
    src = src if src is not None else w4_mma_jit.SOURCE
    dists = re.findall(r"#define XR_DIST \(CPA - (\d+)\)", src)
    assert len(dists) == 2, "kernel source: expected XR_DIST for WG, then for XR"
    wg_body = src[src.index("void compute_chunk_wg("):src.index("void wg_drain(")]
    align = _one(r"STAGE_BYTES \+ (\d+)\) & ~(\d+)u", src, "ring alignment")
    return dict(
        pitch=int(_one(r"#define XR_PITCH (\d+)", src, "XR_PITCH").group(1)),
        sbo=int(_one(r"#define WG_SBO (\d+)", src, "WG_SBO").group(1)),
        dist_back={"WG": int(dists[0]), "XR": int(dists[1])},
        cp_wait_back=int(_one(r"cp_async_wait<XR_DIST - (\d+)>\(\)", src, "ring cp.async wait").group(1)),
        wg_wait=int(_one(r"wgmma\.wait_group\.sync\.aligned (\d+);", wg_body, "WG in-loop wait").group(1)),
        align=int(align.group(1)) + 1 if align.group(1) == align.group(2) else None,
        swizzle128=bool(re.search(r"\(1ull << 62\)", src)),
        barrier="__syncthreads();  // ... and every thread's" in src,
        # the x copies are the CTA's: no ``live`` test may guard them (dead warps copy their share)
        copies_by_all=not re.search(r"live[^;{}]*\)\s*\{?\s*(issue_x|issue_x_wg)\(", src)
        and not re.search(r"if \(live[^\n]*\n(\s*(issue_stage|if)[^\n]*\n)*\s*(issue_x|issue_x_wg)\(", src),
        fence='"fence.proxy.async.shared::cta;"' in src)


def check_ring_schedule(CPA: int, WG: bool, sched: dict) -> int:
    """Assert the ring is safe for this CPA and return its prefetch distance D: at chunk j the
    slot of chunk j + D is refilled (after the barrier), which must be none of the slots of the
    chunks still in use: j .. j + D - 1 (copied, not yet read) and, with WG, the chunks whose
    wgmma groups the previous wait may have left pending (j - depth .. j - 1). And the cp.async
    wait at chunk j must leave chunk j landed (D + j groups committed, chunk j is group j)."""
    assert sched["barrier"], "the ring needs a CTA barrier per chunk"
    assert sched["copies_by_all"], "a live test guards the ring's x copies: dead warps would leave their share out"
    D = CPA - sched["dist_back"]["WG" if WG else "XR"]
    depth = sched["wg_wait"] if WG else 0  # mma.sync reads the ring synchronously
    assert D >= 1, f"CPA {CPA}: prefetch distance {D}"
    assert D + depth <= CPA - 1, f"CPA {CPA}: slot of chunk j + {D} refilled while chunk j - {depth} may be read"
    pending = D - sched["cp_wait_back"]
    assert 0 <= pending <= D - 1, f"CPA {CPA}: cp.async wait leaves {pending} of {D} groups pending: chunk j not landed"
    if WG:
        assert sched["fence"], "WG's ring writes need fence.proxy.async before the wgmmas read them"
        assert sched["swizzle128"] and sched["align"] == 1024, "WG: the 128-byte swizzle needs 1024-byte slots"
    assert sched["pitch"] == w4_mma.XR_PITCH, "XR_PITCH: the kernel's and the host's (xr_bytes) differ"
    return D

