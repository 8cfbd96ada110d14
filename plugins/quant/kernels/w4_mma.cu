// W4A16 GEMM on the "mma" int4 layout (w4_mma.py): y[M, N] = x[M, K] @ dequant(W)[K, N] on
// the tensor cores with mma.sync m16n8k16 (both operands from registers), compiled by NVRTC.
//
// Why mma.sync and not Hopper's wgmma: wgmma reads its B operand (here the activations) from
// shared memory, so every K step pays a store / fence / CTA barrier round trip (the Triton
// kernel's bound, BENCHMARKS.md); mma.sync takes both operands from registers, and a warp
// streams its weights and activations with plain 16-byte loads, never waiting on another.
// The idea of a per-thread weight layout dequantized by LOP3 into MMA fragments is Marlin's
// (Frantar et al., 2024); this kernel is written from the PTX ISA's fragment layouts.
//
// Compile-time constants (-D): W4_BF16 (1 bf16, 0 fp16), NB (token blocks of 8: M <= 8 * NB),
// TW (16-row tiles per warp: 1, 2 or 4), WARPS (warps per CTA), S (register stages: each
// warp keeps S - 1 chunks' loads in flight while it computes one; 1: load, then compute), XS (1: the CTA copies its
// x slice to shared memory once and its warps read it there; 0: each warp loads x itself),
// SCALE_A (1: the group scale multiplies the dequantized operand; 0: each group's product, in
// fp32), MINB (CTAs per SM the register allocation must allow), LDW (1: weight loads bypass
// L1 and prefetch 256 bytes into L2), GCC (64-wide chunks per scale group when it is a
// compile-time constant, else 0), CPA (0: operands through registers as S says; P > 1: a
// P-stage cp.async pipeline in shared memory, P - 1 chunks in flight without holding registers),
// XR (1, with CPA: x goes through a CTA-wide ring of CPA chunk slots in shared memory, one CTA
// barrier per chunk, and each warp reads it half a chunk at a time, so many token blocks (M = 64)
// cost neither 8 * NB registers per lane nor a per-warp copy of x from L1: Marlin's shared A tile),
// WG (1, with XR, sm_90a: warpgroup MMAs with x read from the ring by descriptor, w4_wgmma.cuh;
// the host passes x with each chunk in the layout's K order; 2: the same MMAs fed by a producer
// warp's bulk copies through mbarrier-guarded stages, no CTA barrier per chunk, w4_wgmma_ws.cuh),
// ACT (1: the SwiGLU epilogue of store_out, output N / 2 wide), PDL (1: launched as a
// programmatic dependent: weight prefetch, then griddepcontrol.wait; sm_90+), PDLP (chunks
// per warp PDL prefetches into L2; -1: all), KW (warps of a CTA splitting its K range: warp kw takes the split's groups kw, kw + KW, ...;
// their sums meet in shared memory, so K parallelism costs a CTA barrier, not split K's
// global partials, fence and arrival counter: ~2.5 us per call on the H200, BENCHMARKS.md),
// CLU (0: split K's partials go through global memory, below; else the split count, when the
// splits of a column block are one thread block cluster and sum in distributed shared memory:
// w4_cluster.cuh), CUR (1, with CPA 0: chunk addresses from per-warp bases, Cursor in w4_mma_ops.cuh;
// fewer loop instructions but more registers, so a tuning choice: BENCHMARKS.md session 32),
// WST (1, with WG 2 and an even CPA: the consumers run trips of CPA chunks, each chunk's stage,
// barrier parity and group position compile-time constants, where the group's chunks divide CPA
// and a split's chunk count is even, else the usual loop: ~16% fewer loop instructions, more
// registers, so a tuning choice, often with MINB 4: BENCHMARKS.md session 34).
//
// Layout (w4_mma.py has the packer): 64-row blocks of N ("nblk"), 64-wide chunks of K. Chunk
// c of nblk is 512 int32 words, [tile T (16 rows)][lane][MMA i]: lane = 4g + t holds, for the
// rows n0 = 16T + g and n1 = n0 + 8 and the four K positions p = 16t + 4i + (0..3) of the
// chunk, nibbles at bits 0/16: q[p, n0], q[p+1, n0]; 4/20: the same for n1; 8/24: q[p+2, n0],
// q[p+3, n0]; 12/28: the same for n1. So `(w >> 4j) & 0x000f000f | BIAS` is the A fragment's
// register j as a packed pair BIAS + q (bf16 128 / fp16 1024: q in the mantissa, exact).
// The MMA's K order is a permutation of the chunk's (logical 2t + 8r + h <-> physical
// 16t + 4i + 2r + h), applied to x as well, so a lane's B fragments for the whole chunk are
// x[token][16t .. 16t + 16): two 16-byte loads.
// Scales fp16 [G][N/64][g][8], ordered (T0 n0, T0 n1, T1 n0, ...), and zero points int32
// [G][N/64][g][2]: word h holds tiles 2h and 2h + 1, the zero of row 16T + 8r + g at bits
// 8 (T & 1) + 4r of both 16-bit halves, so one LOP3 makes the -(BIAS + z) pair the dequantization
// subtracts. A lane reads its 2 * TW scales and its words once per group (3 bytes per row and
// group where fp32 scales and 16-bit zeros took 6: 4% of the bytes at group 128).
//
// Split K: grid (ceil(nblk16 / (WARPS / KW * TW)), splits); a split covers `cps` chunks (a
// multiple of the group's chunks). With splits > 1 each writes fp32 partials to ws[split][M][N];
// the last CTA of a column block to arrive (an arrival counter it resets) sums them in split
// order (deterministic) and writes y.
//
// Source: w4_mma_ops.cuh (helpers), w4_mma_stages.cuh (one chunk; cp.async stages), w4_wgmma.cuh (WG),
// w4_wgmma_ws.cuh (WG 2; the x tiles kernel),
// w4_mma_io.cuh (x in: the shared copy, the RMSNorm prologue; y out: the SwiGLU / RoPE
// epilogues), w4_cluster.cuh (CLU's reduction), then this file, joined by w4_mma_jit.SOURCE
// (one NVRTC translation unit).

#ifndef MINB
#define MINB 1
#endif
#ifndef PDL
#define PDL 0
#endif
#ifndef PDLP
#define PDLP -1
#endif
#if WG
#define RING_SLOT WG_SLOT  // one chunk of the XR ring (w4_wgmma.cuh's swizzled layout)
// chunks the ring runs ahead: WG leaves one chunk's wgmmas in flight, so the slot refilled at
// chunk j is that of chunk j - 2, not j - 1
#define XR_DIST (CPA - 2)
#else
#define RING_SLOT (KW * XR_SLOT)
#define XR_DIST (CPA - 1)
#endif

#if CLU  // the splits of a column block are one cluster (w4_cluster.cuh)
#define W4_CLUSTER __cluster_dims__(1, CLU, 1)
#else
#define W4_CLUSTER
#endif
extern "C" __global__ void W4_CLUSTER __launch_bounds__((WARPS + (WG == 2)) * 32, MINB)
w4_mma_gemm(const dt* __restrict__ x, int M, long long stride_x, const uint4* __restrict__ wq,
            const unsigned short* __restrict__ sc, const unsigned* __restrict__ zp, int N, int KC, int gc_rt, int cps, float* __restrict__ ws,
            int* __restrict__ cnt, dt* __restrict__ out, long long stride_o, const dt* __restrict__ res,
            const dt* __restrict__ nw, float eps, dt* __restrict__ res_out, int rope_rows, int hd,
            const long long* __restrict__ pos, const float* __restrict__ cosp, const float* __restrict__ sinp) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int NBLK = N >> 6;
    const int GC = GCC > 0 ? GCC : gc_rt;  // chunks per group: a constant when compiled in (cheap % and /)
    const int kw = warp % KW;                              // this warp's share of the split's groups
    const int unit = blockIdx.x * (WARPS / KW) + warp / KW;  // this warp's TW tiles
    const int nblk = unit / (TILES_PER_BLK / TW);
    const int tile0 = (unit % (TILES_PER_BLK / TW)) * TW;  // first tile inside the 64-row block
    const int splits = gridDim.y, split = blockIdx.y;
    const int cbeg = split * cps, cend = min(cbeg + cps, KC);
    const bool live = nblk < NBLK && (WG != 2 || warp < WARPS);  // (WG 2: warp WARPS is the producer)
    const uint4* wp = wq + (size_t)nblk * KC * 128 + tile0 * 32 + lane;  // this lane's weight vectors
    // this warp's chunks: local chunk j is chunk_of(j); splits hold whole groups
    const int ngrp = (cend - cbeg) / GC;
    const int nloc = chunks_of(kw, ngrp, GC);
#define chunk_of(j) chunk_at(j, kw, cbeg, GC)
#if PDL  // launched as a programmatic dependent (kvforge/layers/pdl.py): only static weights
    // before the wait. Prefetch this warp's into L2 while the kernel before finishes: a warp's
    // 16-byte vectors of one tile are 512 contiguous bytes, so lanes 0, 8, 16, 24 cover its lines.
    // PDLP: chunks per warp to prefetch (-1: all; a weight bigger than L2 would be read twice)
    const int npre = PDLP < 0 ? nloc : min(nloc, PDLP);
    if (live && (lane & 7) == 0)
        for (int j = 0; j < npre; ++j)
#pragma unroll
            for (int a = 0; a < TW; ++a)
                asm volatile("prefetch.global.L2 [%0];" ::"l"(wp + (size_t)chunk_of(j) * 128 + a * 32));
    asm volatile("griddepcontrol.wait;" ::: "memory");  // the previous kernel's writes (x) are visible
#endif
#if XS || CPA || KW > 1 || CLU  // (XR needs CPA)
    extern __shared__ __align__(16) unsigned char smem_raw[];
#endif
#if CPA  // the stages first; this thread's unit 0 of stage 0 (shared-space byte address)
    const unsigned ring = smem_u32(smem_raw) + threadIdx.x * 16;
#endif
#if XS  // then x[0:M, cbeg*64 : cend*64), row pitch xpitch (NORM: whole rows, for their norms)
    dt* xs = reinterpret_cast<dt*>(smem_raw + STAGE_BYTES);
    const int xpitch = (NORM ? KC : cps) * 64 + 8;  // +16 bytes: lanes g and g + 1 hit different banks
    const int xoff = NORM ? 0 : cbeg * 64;           // the copy's first column
#endif

    // this lane's entries of a (group, nblk, g) record: (tile0 + a, r) at 2 * (tile0 + a) + r
    const size_t rec0 = ((size_t)nblk * 8 + g) * 8 + 2 * tile0, rec_step = (size_t)NBLK * 64;
    const dt* xp[NB];
#pragma unroll
    for (int b = 0; b < NB; ++b)  // tokens past M re-read row M - 1; their outputs are dropped
#if XS
        xp[b] = xs + min(b * 8 + g, M - 1) * xpitch + 16 * t - xoff;
#else
        xp[b] = x + (size_t)min(b * 8 + g, M - 1) * stride_x + 16 * t;
#endif
    Acc A;
    FOR_FRAGS A.acc[a][b][f] = 0.f;
    RopeCS cs;  // (ROPE 2) the storing warps' cos / sin, requested now, used by the epilogue
    if (ROPE == 2 && live && kw == 0) rope_load(cs, nblk * 64 + tile0 * 16 + g, t, M, rope_rows, hd, pos, cosp, sinp);
#if CPA && !XR
    if (live) {  // prologue: chunks cbeg .. cbeg + CPA - 2 in flight (one commit group each)
#pragma unroll
        for (int s = 0; s < CPA - 1; ++s) {
            if (s < nloc) issue_stage(ring + s * UNITS * NT * 16, wp, xp, sc, zp, rec0, rec_step, chunk_of(s), GC);
            cp_async_commit();
        }
    }
#else
    Stage st[S];
#if CUR  // local chunk j's operands from per-warp bases (Cursor); else from its chunk index
    const Cursor cur(wp, xp, sc, zp, rec0, rec_step, chunk_of(0), GC);
#define LOAD_CHUNK(stage, j) cur.load(stage, j, GC)
#else
#define LOAD_CHUNK(stage, j) load_stage(stage, wp, xp, sc, zp, rec0, rec_step, chunk_of(j), GC)
#endif
    if (live) {  // prologue: chunks cbeg .. cbeg + S - 2 in flight
#pragma unroll
        for (int s = 0; s < S - 1; ++s)
            if (s < nloc) LOAD_CHUNK(st[s], s);
        // the norm prologue waits on L2 round trips: with S = 1 the first chunk loads meanwhile
        if (NORM && S == 1 && nloc > 0) LOAD_CHUNK(st[0], 0);
    }
#endif
#if NORM
    fill_x_norm(xs, x, M, stride_x, xpitch, KC * 64, res, nw, eps, res_out, cbeg, cend);  // every thread
#elif XS
    fill_x(xs, x, M, stride_x, xpitch, cbeg, cend);  // every thread: it ends in a CTA barrier
#endif
#if WG == 2  // a producer warp's bulk copies through mbarrier-guarded stages (w4_wgmma_ws.cuh)
    ws_gemm(A, x, M, wq, sc, zp, KC, NBLK, cbeg, nloc, GC, smem_u32(smem_raw));
#elif XR  // x through the CTA's ring, weights through each thread's stages, one commit group per chunk
    {
#if WG  // the swizzle is anchored on address bits 7-9: 1024-byte aligned slots (the host adds 1 KB)
        const unsigned xring = (smem_u32(smem_raw) + STAGE_BYTES + 1023) & ~1023u;
        unsigned frA[4][4] = {}, frB[4][4] = {};  // A fragments of the chunk in flight and the next
#else  // this lane's x (row g, column 16t) of share kw in slot 0
        const unsigned xring = smem_u32(smem_raw) + STAGE_BYTES;
        const unsigned xlane = xring + (kw * NB * 8 + g) * XR_PITCH + 32 * t;
#endif
        // kw 0 has the most chunks: every warp runs its count, so all reach each barrier
        const int nmax = chunks_of(0, ngrp, GC);
#pragma unroll
        for (int s = 0; s < XR_DIST; ++s) {  // prologue: chunks 0 .. XR_DIST - 1 in flight
            if (s < nmax) {
                if (live && s < nloc) issue_stage(ring + s * UNITS * NT * 16, wp, xp, sc, zp, rec0, rec_step, chunk_of(s), GC);
#if WG
                issue_x_wg(xring + s * RING_SLOT, x, M, stride_x, cbeg + s);
#else
                issue_x(xring + s * RING_SLOT, x, M, stride_x, s, cbeg, ngrp, GC);
#endif
            }
            cp_async_commit();
        }
        // one chunk; fc / fp: WG's A fragments of this chunk and of the previous one (in flight)
        auto step = [&](int j, unsigned (&fc)[4][4], unsigned (&fp)[4][4]) {
            cp_async_wait<XR_DIST - 1>();  // this thread's copies of chunk j have landed ...
#if WG  // ... and are visible to the tensor cores' (async proxy) reads of the ring
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
            __syncthreads();  // ... and every thread's; no warp reads the slot refilled next any more
            const int nxt = j + XR_DIST, nslot = nxt % CPA;
            if (nxt < nmax) {
                if (live && nxt < nloc)
                    issue_stage(ring + nslot * UNITS * NT * 16, wp, xp, sc, zp, rec0, rec_step, chunk_of(nxt), GC);
#if WG
                issue_x_wg(xring + nslot * RING_SLOT, x, M, stride_x, cbeg + nxt);
#else
                issue_x(xring + nslot * RING_SLOT, x, M, stride_x, nxt, cbeg, ngrp, GC);
#endif
            }
            cp_async_commit();
            if (live && j < nloc) {
                const int slot = j % CPA;
                const bool gstart = j % GC == 0;
                Stage cur;
                read_stage(cur, ring + slot * UNITS * NT * 16, gstart, 8 * (tile0 & 1));
#if WG
                compute_chunk_wg(A, cur, gstart, xring + slot * RING_SLOT, fc, fp);
#else
                compute_chunk(A, cur, gstart, j % GC == GC - 1, xlane + slot * RING_SLOT);
#endif
            }
        };
#if WG  // two chunks per trip, so each fragment buffer is a fixed set of registers
        for (int j = 0; j < nmax; j += 2) {
            step(j, frA, frB);
            if (j + 1 < nmax) step(j + 1, frB, frA);
        }
        // every warpgroup, a dead one too (it waits on nothing): under a branch, ptxas would
        // serialize all the wgmmas (C7518)
        wg_drain(A, frA, frB);
#else
        unsigned unused[4][4];
        for (int j = 0; j < nmax; ++j) step(j, unused, unused);
#endif
        cp_async_wait<0>();  // no copy may land after the CTA ends
    }
#else
    if (live) {
#if CPA
        int slot = 0;  // the stage holding local chunk j; chunk j + CPA - 1 goes to the one before it
        for (int j = 0; j < nloc; ++j) {
            const int prev = slot == 0 ? CPA - 1 : slot - 1;  // consumed by the previous chunk
            if (j + CPA - 1 < nloc)
                issue_stage(ring + prev * UNITS * NT * 16, wp, xp, sc, zp, rec0, rec_step, chunk_of(j + CPA - 1), GC);
            cp_async_commit();
            cp_async_wait<CPA - 1>();  // this thread's copies of chunk j have landed
            const bool gstart = j % GC == 0;
            Stage cur;
            read_stage(cur, ring + slot * UNITS * NT * 16, gstart, 8 * (tile0 & 1));
#if XS
            x_from_smem(cur, xp, chunk_of(j));
#endif
            compute_chunk(A, cur, gstart, j % GC == GC - 1);
            slot = slot == CPA - 1 ? 0 : slot + 1;
        }
        cp_async_wait<0>();  // no copy may land after the CTA ends (empty groups complete at once)
#else
        // CUR: a warp holds whole groups, so when S divides the (compile-time) group's chunks no
        // trip runs past its last chunk: no per-chunk test (a branch and a convergence barrier
        // each), and the look-ahead past the last chunk reloads it instead
        constexpr bool WHOLE = CUR && GCC > 0 && GCC % S == 0;
        for (int j0 = 0; j0 < nloc; j0 += S) {
#pragma unroll
            for (int s = 0; s < S; ++s) {
                const int j = j0 + s;
                if (S == 1 && (WHOLE || j < nloc) && !(NORM && j == 0))  // load, then compute (fewer registers, more warps)
                    LOAD_CHUNK(st[0], j);
                else if (S > 1 && WHOLE)  // keep S - 1 chunks in flight
                    LOAD_CHUNK(st[(s + S - 1) % S], min(j + S - 1, nloc - 1));
                else if (S > 1 && j + S - 1 < nloc)
                    LOAD_CHUNK(st[(s + S - 1) % S], j + S - 1);
                if (WHOLE || j < nloc) {
#if XS
                    x_from_smem(st[s], xp, chunk_of(j));
#endif
                    compute_chunk(A, st[s], j % GC == 0, j % GC == GC - 1);
                }
            }
        }
#endif
    }
#endif  // XR

#undef chunk_of
#undef LOAD_CHUNK
#if PDL  // the loads are done: the next kernel (if launched as a dependent) may start its prologue
    asm volatile("griddepcontrol.launch_dependents;");
#endif
#if KW > 1
    // the K-splitting warps' sums meet in shared memory (the stages / x slice are done with);
    // warp kw == 0 adds them in kw order (deterministic) and goes on alone
    __syncthreads();
    float* red = reinterpret_cast<float*>(smem_raw);
    const int frag0 = (warp / KW) * (TW * NB * 4);  // this column of warps' fragments
#define RED_AT(k) red[((k - 1) * (WARPS / KW) * TW * NB * 4 + frag0 + (a * NB + b) * 4 + f) * 32 + lane]
    if (kw > 0) {
        FOR_FRAGS RED_AT(kw) = A.acc[a][b][f];
    }
    __syncthreads();
    if (kw == 0) {
        for (int k2 = 1; k2 < KW; ++k2) {
            FOR_FRAGS A.acc[a][b][f] += RED_AT(k2);
        }
    }
#undef RED_AT
    const bool owner = live && kw == 0;
#else
    const bool owner = live;
#endif
    // accumulator f of (tile a, token block b): row nbase + 16a + 8 * (f >> 1), token 8b + 2t + (f & 1)
#if WG == 2 && WST
    const int nbase = ws_nbase(warp, g);  // (not kept live across WST's trips: w4_wgmma_ws.cuh)
#else
    const int nbase = nblk * 64 + tile0 * 16 + g;
#endif
#define FRAG_TOK (8 * b + 2 * t + (f & 1))
#define FRAG_ROW (nbase + 16 * a + 8 * (f >> 1))
#if CLU  // gridDim.y == CLU: the splits' sums meet in the cluster's shared memory
    if (cluster_reduce(A, owner, smem_u32(smem_raw))) store_out(A.acc, out, stride_o, M, nbase, t, cs, rope_rows, hd);
    return;
#endif
    if (splits == 1) {
        if (owner) store_out(A.acc, out, stride_o, M, nbase, t, cs, rope_rows, hd);
        return;
    }
    if (owner) {
        FOR_FRAGS if (FRAG_TOK < M) ws[((size_t)split * M + FRAG_TOK) * N + FRAG_ROW] = A.acc[a][b][f];
    }
    __threadfence();  // this thread's partials are visible device-wide before the count
    __syncthreads();
    __shared__ int last;
    if (threadIdx.x == 0) {
        last = atomicAdd(cnt + blockIdx.x, 1) == splits - 1;
        if (last) cnt[blockIdx.x] = 0;  // ready for the next launch (and CUDA graph replay)
    }
    __syncthreads();
    if (!last || !owner) return;
    __threadfence();
    // split order (deterministic); one split's loads all in flight at once, not one by one
    FOR_FRAGS A.acc[a][b][f] = 0.f;
    for (int k = 0; k < splits; ++k) {
        const float* wk = ws + (size_t)k * M * N;
        FOR_FRAGS if (FRAG_TOK < M) A.acc[a][b][f] += __ldcg(wk + (size_t)FRAG_TOK * N + FRAG_ROW);
    }
    store_out(A.acc, out, stride_o, M, nbase, t, cs, rope_rows, hd);
#undef FRAG_TOK
#undef FRAG_ROW
}

// W^T [N, K] = (q - z) * s (fp32 math, rounded once) in x's dtype, for the prefill path
// (cuBLAS multiplies it next). One thread per (nblk, chunk, tile, lane): its four words
// cover rows n0, n1 and K positions 16t .. 16t + 16 of the chunk: two 32-byte row runs.
extern "C" __global__ void w4_mma_dequant(const uint4* __restrict__ wq, const unsigned short* __restrict__ sc,
                                          const unsigned* __restrict__ zp,
                                          int N, int KC, int GC, dt* __restrict__ wt) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int NBLK = N >> 6;
    if (idx >= (long long)NBLK * KC * 128) return;
    const int lane = idx & 31, tile = (idx >> 5) & 3;
    const long long rest = idx >> 7;
    const int c = rest % KC, nblk = rest / KC;
    const int g = lane >> 2, t = lane & 3;
    const uint4 v = __ldg(wq + idx);
    const size_t gq = ((size_t)(c / GC) * NBLK + nblk) * 8 + g;
    const unsigned zw = __ldg(zp + gq * 2 + (tile >> 1));
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // row n0 (r = 0) or n1
        const float s = h16_to_f(sc[gq * 8 + 2 * tile + r]), z = (float)((zw >> (8 * (tile & 1) + 4 * r)) & 15);
        __align__(16) dt vals[16];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const unsigned w = word_of(v, i);
#pragma unroll
            for (int e = 0; e < 4; ++e) {  // K position 4i + e: nibble of register 2 * (e >> 1) + r, half e & 1
                const int bit = 4 * (2 * (e >> 1) + r) + 16 * (e & 1);
                vals[4 * i + e] = f_to_dt(((float)((w >> bit) & 15) - z) * s);
            }
        }
        const size_t row = (size_t)nblk * 64 + tile * 16 + g + 8 * r;
        uint4* dst = reinterpret_cast<uint4*>(wt + row * ((size_t)KC * 64) + (size_t)c * 64 + 16 * t);
        dst[0] = *reinterpret_cast<uint4*>(&vals[0]);
        dst[1] = *reinterpret_cast<uint4*>(&vals[8]);
    }
}
