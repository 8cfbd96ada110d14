"""WG 2 of ``w4_mma_gemm`` (w4_wgmma_ws.cuh) as its source states it, for the CPU emulation
(tests/w4_mma_emulate.py): the stage layout, the mbarrier protocol (init counts, parities,
releases), the producer's bulk copies and the consumer lane's shared-memory reads are parsed
from ``w4_mma_jit.SOURCE`` and replayed, so an edit to the .cuh changes what the emulation runs.

* :func:`check_ws_protocol` replays the producer and the consumer warps in random interleavings
  with mbarrier semantics;
* :func:`ws_stage_emu` fills one stage byte by byte from the parsed copies (bounds, overlap and
  the expected transaction bytes checked) and reads a lane's operands from it as the consumer
  does."""
from __future__ import annotations

import re

import numpy as np

from kvforge_plugins.quant.kernels import w4_mma_jit
from w4_mma_emulate_sched import _one

ELEM_BYTES = {"xt": 2, "wq": 16, "sc": 2, "zp": 4}  # ws_loop's global operands: dt, uint4, fp16 bits, words


def _ternary(text: str) -> str:
    """A top-level C ``a ? b : c`` as Python's ``(b if a else c)``; ``c`` may hold another
    (right-associative). Parenthesized ones are ``_py``'s regex's."""
    depth, q = 0, None
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if depth == 0 and ch == "?" and q is None:
            q = i
        elif depth == 0 and ch == ":" and q is not None:
            return f"(({text[q + 1:i].strip()}) if ({text[:q].strip()}) else ({_ternary(text[i + 1:]).strip()}))"
    return text


def _py(text: str) -> str:
    """A C integer expression of the kernel as Python (casts dropped, ``/`` on non-negative
    ints, ``?:`` as a conditional expression)."""
    text = text.replace("(size_t)", "").replace("/", "//")
    return _ternary(re.sub(r"\((\w+) \? ([^:()]+) : ([^()]+)\)", r"(\2 if \1 else \3)", text))


def _c_expr(text: str, **names):
    """Evaluate a C integer expression of the kernel source."""
    return eval(_py(text), {}, names)  # noqa: S307 (our own source)


def ws_layout(src: "str | None" = None) -> dict:
    """WG 2's stage layout as w4_wgmma_ws.cuh defines it: functions of (NB, WARPS) for the
    consumer warpgroups (``wgs``), the weights' (``w``) and the scales' (``sz``) offsets in a
    stage, a block's scale + zero-point record (``rec``) and the stage's size (``stage``)."""
    src = src if src is not None else w4_mma_jit.SOURCE
    defs = {name: _one(rf"#define {name} ([^\n]*)", src, name).group(1).split("//")[0].strip()
            for name in ("WS_WGS", "WS_W", "WS_SZ", "WS_REC", "WS_STAGE")}

    def expand(text):
        while re.search(r"\bWS_\w+\b", text):
            text = re.sub(r"\bWS_\w+\b", lambda m: f"({defs[m.group(0)]})", text)
        return text
    return {name.lower()[3:]: (lambda NB, WARPS, e=expand(defs[name]): _c_expr(e, NB=NB, WARPS=WARPS))
            for name in defs}


def ws_protocol(src: "str | None" = None) -> dict:
    """WG 2's protocol as the source states it: the mbarriers' init counts (full, empty), the
    parity the producer waits on the empty barrier with before refilling for chunk j, the
    parity a consumer waits on the full barrier with, which chunk's stage a consumer releases
    after step j (one arrival per warp), the wgmma wait depth, the stages' alignment; and the
    producer's copies (destination offset, source operand and offset, bytes; per block / per
    group start), its expected bytes, and the consumer's reads (weights, scales, zeros, x)."""
    src = src if src is not None else w4_mma_jit.SOURCE
    body = src[src.index("void ws_loop("):src.index("extern \"C\" __global__ void w4_x_tiles")]
    producer = body[body.index("if (warp == WARPS) {"):body.index("const int wb = warp >> 2")]
    empty = _one(r"if \(j >= CPA\) mbar_wait\(EMPTY\(s\), ([^;]*)\);", body, "producer's empty wait")
    # the consumer's chunk (run): its stage, full-barrier parity, group start and the stage it
    # releases, as the generic step and WST's trips pass them
    _one(r"auto run = \[&\]\(int s, unsigned parity, bool gs, int prev,", body, "consumer's chunk")
    _one(r"mbar_wait\(FULL\(s\), parity\);", body, "consumer's full wait")
    _one(r"if \(prev >= 0 && lane == 0\) mbar_arrive\(EMPTY\(prev\)\);", body, "consumer's release")
    step = _one(r"run\(([^,]+), ([^,]+), ([^,]+), ([^,]+), fc, fp\);", body, "generic step").groups()
    wst = body[body.index("#if WST"):body.index("#endif", body.index("#if WST"))]
    trip = [m.groups() for m in re.finditer(r"run\((u|u \+ 1), ([^,]+), ([^,]+), ([^,]+), fr[AB], fr[AB]\);", wst)]
    assert [t[0] for t in trip] == ["u", "u + 1"], f"WST trip: expected runs of u and u + 1, found {trip}"
    align = _one(r"ws_loop\([^;]*\(smem \+ (\d+)\) & ~(\d+)u", src, "WG 2 stage alignment")
    per_block, gs_only = producer.index("for (int b = 0; b < nb; ++b)"), producer.index("if (gs) {")
    copies = [dict(dst=m.group(1), arr=m.group(2), src=m.group(3), bytes=m.group(4),
                   per_block=m.start() > per_block, gs_only=m.start() > gs_only)
              for m in re.finditer(r"bulk_copy\(([^,]+), (\w+) \+ ([^,]+), ([^,]+), FULL\(s\)\);", producer)]
    return dict(
        full_init=_one(r"mbar_init\(bars \+ 8 \* s, ([^;]*)\);", src, "full barrier init").group(1),
        empty_init=_one(r"mbar_init\(bars \+ 8 \* \(CPA \+ s\), ([^;]*)\);", src, "empty barrier init").group(1),
        empty_parity=empty.group(1), step=step, trip=trip,
        align=int(align.group(1)) + 1 if align.group(1) == align.group(2) else None,
        wait_depth=int(_one(r"wgmma\.wait_group\.sync\.aligned (\d+);",
                            src[src.index("void compute_chunk_wg("):src.index("void wg_drain(")],
                            "WG in-loop wait").group(1)),
        copies=copies, rec=_one(r"const size_t rec = ([^;]*);", producer, "scale record").group(1),
        expect=_one(r"mbar_expect_tx\(FULL\(s\), ([^;]*)\);", producer, "expected bytes").group(1),
        read_w=_one(r"cur\.w\[0\] = lds128\(([^;]*)\);", body, "weight read").group(1),
        sz=_one(r"const unsigned sz = ([^,]*), e = ([^;]*);", body, "scale record address").groups(),
        read_s=_one(r"\"=r\"\(s2\) : \"r\"\(([^)]*)\)\);", body, "scales read").group(1),
        read_z=_one(r"\"=r\"\(z\) : \"r\"\((.*?)\)\);", body, "zeros read").group(1),
        z_shift=_one(r"cur\.z\[0\] = z >> ([^;]*);", body, "zero-point shift").group(1),
        x_at=_one(r"compute_chunk_wg\(A, cur, gs, ([^,]*), fc, fp\);", body, "x slot").group(1))


def consumer_chunk(proto: dict, j: int, CPA: int, GC: int, nloc: int, wst: bool) -> tuple:
    """(stage, full-barrier parity, group start, released stage or -1) of a consumer's chunk
    ``j``: WST's trips (chunks below the last multiple of CPA, when ``wst``) or the generic step."""
    nmain = nloc - nloc % CPA
    if wst and j < nmain:
        u, r = j % CPA, j // CPA
        names = dict(u=u - u % 2, r=r, CPA=CPA, GCC=GC)  # (the loop's u steps by 2: u, then u + 1)
        return tuple(_c_expr(e, **names) for e in proto["trip"][u % 2])
    return tuple(_c_expr(e, j=j, CPA=CPA, GC=GC) for e in proto["step"])


def check_ws_protocol(CPA: int, nloc: int, nb: int, rng, proto: "dict | None" = None, GC: int = 1,
                      wst: bool = False) -> None:
    """Replay WG 2's producer and the 4 * ``nb`` warps of its live consumer warpgroups over
    ``nloc`` chunks in a random interleaving, with mbarrier semantics (a phase completes when
    the init count of arrivals is in; a wait on parity P passes once the phase of parity P has
    completed). ``wst``: the consumers run WST's trips of CPA chunks (w4_wgmma_ws.cuh). Asserts
    that each consumer reads chunk j from a stage holding chunk j, opens a scale group where the
    producer copied one (every GC chunks), that no stage is refilled while a warp may still read
    it (its wgmmas retire ``wait_depth`` steps later) and that nothing deadlocks."""
    proto = proto or ws_protocol()
    warps = 4 * nb
    phase = {("full", s): 0 for s in range(CPA)} | {("empty", s): 0 for s in range(CPA)}
    count = dict.fromkeys(phase, 0)
    need = {("full", s): _c_expr(proto["full_init"], nb=nb) for s in range(CPA)} | \
        {("empty", s): _c_expr(proto["empty_init"], nb=nb) for s in range(CPA)}
    holds = [None] * CPA  # the chunk a stage holds
    reading = [set() for _ in range(CPA)]  # (warp, chunk) whose reads of the stage may be in flight
    nxt_p, nxt_c = 0, [0] * warps
    chunk = [consumer_chunk(proto, j, CPA, GC, nloc, wst) for j in range(nloc)]

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
            if j < nloc and passes(("full", chunk[j][0]), chunk[j][1]):
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
            s, _, gs, rel = chunk[j]
            assert holds[s] == j, f"CPA {CPA}: warp {who} reads chunk {j} from a stage holding {holds[s]}"
            assert bool(gs) == (j % GC == 0), f"CPA {CPA}: chunk {j} opens a group: {bool(gs)}, copied as {j % GC == 0}"
            reading[s].add((who, j))
            for st in reading:  # the wait retires all but the last wait_depth chunks' wgmmas
                st.difference_update({(who, c) for c in range(j - proto["wait_depth"] + 1)})
            if rel >= 0:
                assert not any(w == who for w, _ in reading[rel]), "a stage released while its wgmmas are in flight"
                arrive(("empty", rel))
            nxt_c[who] += 1


def ws_stage_emu(proto, lay, arrays, *, NB, WARPS, M, KC, NBLK, GC, c, gs, blk0, nb):
    """The producer's copies of chunk ``c`` into one stage, byte by byte from ``arrays`` (the
    global operands as flat uint8 arrays, keyed xt / wq / sc / zp): each in the operand's and
    the stage's bounds, none overlapping another, their bytes the expected transaction count.
    Returns (stage bytes, written mask)."""
    W, SZ, size = lay["w"](NB, WARPS), lay["sz"](NB, WARPS), lay["stage"](NB, WARPS)
    stage = np.zeros(size, dtype=np.uint8)
    written = np.zeros(size, dtype=bool)
    total = 0
    for cp in proto["copies"]:
        if cp["gs_only"] and not gs:
            continue
        for b in range(nb) if cp["per_block"] else [None]:
            names = dict(st=0, WS_W=W, WS_SZ=SZ, WS_REC=lay["rec"](NB, WARPS), b=b, c=c, M=M, KC=KC, NBLK=NBLK, GC=GC, blk0=blk0)
            names["rec"] = _c_expr(proto["rec"], **names) if cp["per_block"] else None
            dst, n = _c_expr(cp["dst"], **names), _c_expr(cp["bytes"], **names)
            src = _c_expr(cp["src"], **names) * ELEM_BYTES[cp["arr"]]
            arr = arrays[cp["arr"]]
            assert n % 16 == 0 and dst % 16 == 0 and src % 16 == 0, f"bulk copy {cp}: not 16-byte aligned"
            assert 0 <= src and src + n <= len(arr), f"bulk copy {cp}: source out of bounds"
            assert 0 <= dst and dst + n <= size and not written[dst:dst + n].any(), f"bulk copy {cp}: stage overrun"
            stage[dst:dst + n], written[dst:dst + n] = arr[src:src + n], True
            total += n
    assert total == _c_expr(proto["expect"], M=M, nb=nb, gs=gs, WS_REC=lay["rec"](NB, WARPS)), \
        "WG 2: expected transaction bytes != copied bytes"
    return stage, written


def ws_lane_reads(proto, lay, stage, written, *, NB, WARPS, warp, gs):
    """A consumer warp's reads of one stage, lane by lane: (weight words uint32 [32, 4], scales
    fp16 bits uint16 [32, 2] and the zero-point word uint32 [32, 1], shifted as the lane does, when ``gs``, the x slot uint16 [NB * 512] the
    descriptor reads from). Each read must be of bytes the producer wrote for this chunk."""
    lane = np.arange(32)
    names = dict(st=0, WS_W=lay["w"](NB, WARPS), WS_SZ=lay["sz"](NB, WARPS), WS_REC=lay["rec"](NB, WARPS), wb=warp // 4, tile=warp % 4,
                 lane=lane, g=lane >> 2)

    def read(at, n):
        at = np.broadcast_to(np.asarray(at), (32,))
        idx = at[:, None] + np.arange(n)
        assert (idx >= 0).all() and (idx < len(stage)).all() and written[idx].all(), "WG 2: read of unwritten bytes"
        return stage[idx]
    out = {"w": read(_c_expr(proto["read_w"], **names), 16).view(np.uint32).reshape(32, 4)}
    if gs:
        names["sz"], names["e"] = (_c_expr(t, **names) for t in proto["sz"])
        out["s"] = read(_c_expr(proto["read_s"], **names), 4).view(np.uint16).reshape(32, 2)
        z = read(_c_expr(proto["read_z"], **names), 4).view(np.uint32).reshape(32)
        out["z"] = (z >> np.uint32(_c_expr(proto["z_shift"], **names)))[:, None]
    x0 = _c_expr(proto["x_at"], **names)
    out["x"] = stage[x0:x0 + NB * 1024].view(np.uint16).copy()
    out["x"][~written[x0:x0 + NB * 1024].reshape(-1, 2).all(1)] = 0x7FFF  # unwritten rows: NaN (never stored)
    return out
