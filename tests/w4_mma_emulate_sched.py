"""The XR / WG ring schedule of ``w4_mma_gemm`` as the kernel source states it, for the CPU
emulation (tests/w4_mma_emulate.py): the constants are parsed from ``w4_mma_jit.SOURCE`` instead
of being restated here, so an edit to the .cu / .cuh changes what the emulation replays (and its
bounds checks see it), and :func:`check_ring_schedule` proves, for a CPA, that no ring slot is
refilled while a chunk in it may still be read: by an in-flight wgmma group (WG's wait depth)
or before its copies land (the cp.async wait count)."""
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


def _c_expr(text: str, **names):
    """Evaluate a C integer expression of the kernel source (``/`` on non-negative ints)."""
    return eval(text.replace("/", "//"), {}, names)  # noqa: S307 (our own source)


def ws_layout(src: "str | None" = None) -> dict:
    """WG 2's stage layout as w4_wgmma_ws.cuh defines it: functions of (NB, WARPS) for the
    consumer warpgroups (``wgs``), the weights' (``w``) and the scales' (``sz``) offsets in a
    stage and the stage's size (``stage``)."""
    src = src if src is not None else w4_mma_jit.SOURCE
    defs = {name: _one(rf"#define {name} ([^\n]*)", src, name).group(1).split("//")[0].strip()
            for name in ("WS_WGS", "WS_W", "WS_SZ", "WS_STAGE")}

    def expand(text):
        while re.search(r"\bWS_\w+\b", text):
            text = re.sub(r"\bWS_\w+\b", lambda m: f"({defs[m.group(0)]})", text)
        return text
    return {name.lower()[3:]: (lambda NB, WARPS, e=expand(defs[name]): _c_expr(e, NB=NB, WARPS=WARPS))
            for name in defs}


def ws_protocol(src: "str | None" = None) -> dict:
    """WG 2's mbarrier protocol as the source states it: the parity the producer waits on the
    empty barrier with before refilling for chunk j (and from which j), the parity a consumer
    waits on the full barrier with, and which chunk's stage a consumer releases after step j."""
    src = src if src is not None else w4_mma_jit.SOURCE
    body = src[src.index("void ws_loop("):src.index("extern \"C\" __global__ void w4_x_tiles")]
    empty = _one(r"if \(j >= CPA\) mbar_wait\(EMPTY\(s\), ([^;]*)\);", body, "producer's empty wait")
    full = _one(r"mbar_wait\(FULL\(s\), ([^;]*)\);", body, "consumer's full wait")
    rel = _one(r"if \(j > 0 && lane == 0\) mbar_arrive\(EMPTY\(\(([^;]*)\) % CPA\)\);", body, "consumer's release")
    align = _one(r"ws_loop\([^;]*\(smem_u32\(smem_raw\) \+ (\d+)\) & ~(\d+)u", src, "WG 2 stage alignment")
    return dict(empty_parity=empty.group(1), full_parity=full.group(1), released=rel.group(1),
                align=int(align.group(1)) + 1 if align.group(1) == align.group(2) else None,
                wait_depth=int(_one(r"wgmma\.wait_group\.sync\.aligned (\d+);",
                                    src[src.index("void compute_chunk_wg("):src.index("void wg_drain(")],
                                    "WG in-loop wait").group(1)))


def check_ws_protocol(CPA: int, nloc: int, warps: int, rng, proto: "dict | None" = None) -> None:
    """Replay WG 2's producer and ``warps`` consumer warps over ``nloc`` chunks in a random
    interleaving, with mbarrier semantics (a phase completes when its arrivals are in; a wait
    on parity P passes once the phase of parity P has completed). Asserts that each consumer
    reads chunk j from a stage holding chunk j, that no stage is refilled while a warp may still
    read it (its wgmmas retire ``wait_depth`` steps later) and that nothing deadlocks."""
    proto = proto or ws_protocol()
    phase = {("full", s): 0 for s in range(CPA)} | {("empty", s): 0 for s in range(CPA)}
    count = dict.fromkeys(phase, 0)
    need = {("full", s): 1 for s in range(CPA)} | {("empty", s): warps for s in range(CPA)}
    holds = [None] * CPA  # the chunk a stage holds
    reading = [set() for _ in range(CPA)]  # (warp, chunk) whose reads of the stage may be in flight
    nxt_p, nxt_c = 0, [0] * warps

    def arrive(bar):
        count[bar] += 1
        if count[bar] == need[bar]:
            count[bar], phase[bar] = 0, phase[bar] + 1

    def passes(bar, parity):  # the phase of that parity has completed: the current one has the other
        return phase[bar] % 2 != parity

    while nxt_p < nloc or min(nxt_c) < nloc:
        movers = []
        if nxt_p < nloc:
            j = nxt_p
            if j < CPA or passes(("empty", j % CPA), _c_expr(proto["empty_parity"], j=j, CPA=CPA)):
                movers.append("p")
        for w in range(warps):
            j = nxt_c[w]
            if j < nloc and passes(("full", j % CPA), _c_expr(proto["full_parity"], j=j, CPA=CPA)):
                movers.append(w)
        assert movers, f"CPA {CPA}: deadlock (producer at {nxt_p}, consumers at {nxt_c})"
        who = movers[rng.randrange(len(movers))]
        if who == "p":
            s = nxt_p % CPA
            assert not reading[s], f"CPA {CPA}: stage {s} refilled for chunk {nxt_p} while {sorted(reading[s])} read it"
            holds[s] = nxt_p
            arrive(("full", s))  # (the bytes land with the arrival: complete_tx)
            nxt_p += 1
        else:
            j = nxt_c[who]
            s = j % CPA
            assert holds[s] == j, f"CPA {CPA}: warp {who} reads chunk {j} from a stage holding {holds[s]}"
            reading[s].add((who, j))
            for st in reading:  # the wait retires all but the last wait_depth chunks' wgmmas
                st.difference_update({(who, c) for c in range(j - proto["wait_depth"] + 1)})
            if j > 0:
                r = _c_expr(proto["released"], j=j)
                assert all((who, c) not in st for st in reading for c in range(r, r + 1)), "released in flight"
                arrive(("empty", r % CPA))
            nxt_c[who] += 1
