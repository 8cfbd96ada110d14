// WG 2: WG's warpgroup MMAs fed by a producer warp instead of a CTA barrier per chunk (the
// warp-specialized structure of CUTLASS's Hopper GEMMs and of NVIDIA's Machete mixed-input
// GEMM). The CTA is WARPS / 4 consumer warpgroups (one 64-row block each) plus one producer
// warp. For each chunk the producer's lane 0 issues 1-D bulk copies (cp.async.bulk, the TMA
// unit; PTX ISA "Data Movement and Conversion Instructions: cp.async.bulk") of x, of each
// block's 2 KB of weight words and, when the chunk opens a scale group, of each block's 128
// bytes of scales and 64 bytes of zero points into one of CPA stages, and one mbarrier per stage
// ("full") counts their bytes. A consumer warp waits on the stage's full barrier, reads its
// weight words, dequantizes them into A fragments and issues its wgmmas (x read from the
// stage by descriptor); once a chunk's wgmmas have retired (the next chunk's wait_group 1)
// each warp arrives on that stage's "empty" barrier, which the producer waits on before
// refilling it. Warpgroups never wait for each other: only the data and the free stages order
// them. WST (a tuning choice; an even CPA): the consumers' loop in trips of CPA chunks, so that a
// chunk's stage, parity, group start and released stage are constants, where the group's chunks
// (GCC) divide CPA and the chunk count is even; else the usual loop. Compiled after w4_wgmma.cuh.
//
// x comes from the host in tiles (``w4_mma_orders.wg_x_tiles``): chunk c is M rows of 128
// bytes, each in the layout's K order with its 16-byte units already at their 128-byte-swizzle
// places, contiguous, so one bulk copy lands it exactly as the descriptor reads it. Tokens
// M .. 8 * NB - 1 of the slot are left unwritten: the MMAs' columns for them are garbage that
// store_out never writes (each token is its own column of D).

#ifndef WG
#define WG 0
#endif
#if WG == 2
#define WS_WGS (WARPS / 4)                       // consumer warpgroups = 64-row blocks of the CTA
#define WS_W (NB * 1024)                         // stage offset of the weights (x first)
#define WS_SZ (WS_W + WS_WGS * 2048)             // of the scales (128 B) + zero points (64 B) per block
#define WS_REC 192
#define WS_STAGE ((WS_SZ + WS_WGS * WS_REC + 1023) & ~1023)  // 1024-aligned: x's swizzle atom
#define WS_THREADS ((WARPS + 1) * 32)

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}" ::"r"(bar), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}" ::"r"(bar) : "memory");
}
// Until the barrier's phase of parity ``parity`` has completed.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    unsigned done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
    } while (!done);
}
// ``bytes`` (a multiple of 16; both addresses 16-byte aligned) from global to shared memory,
// completing that many bytes of the transaction count of ``bar``.
__device__ __forceinline__ void bulk_copy(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

// The chunks [cbeg, cbeg + nloc) of the CTA's blocks blk0 .. blk0 + nb - 1 (nb live ones);
// ``stages``: the 1024-aligned shared address of stage 0; ``bars``: 2 * CPA mbarriers (full,
// then empty). Consumers end with their accumulators in A; the producer warp returns at once
// after its last copy (its lanes 1-31 at the start).
__device__ __forceinline__ void ws_loop(Acc& A, const dt* xt, int M, const uint4* wq, const unsigned short* sc,
                                        const unsigned* zp,
                                        int KC, int NBLK, int cbeg, int nloc, int GC, int blk0, int nb,
                                        unsigned stages, unsigned bars) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#define FULL(s) (bars + 8 * (s))
#define EMPTY(s) (bars + 8 * (CPA + (s)))
    if (warp == WARPS) {  // the producer
        if (lane != 0) return;
        for (int j = 0; j < nloc; ++j) {
            const int s = j % CPA, c = cbeg + j;
            if (j >= CPA) mbar_wait(EMPTY(s), (j / CPA - 1) & 1);  // its chunk j - CPA retired in every warp
            const bool gs = j % GC == 0;
            const unsigned st = stages + s * WS_STAGE;
            mbar_expect_tx(FULL(s), M * 128 + nb * (gs ? 2048 + WS_REC : 2048));
            bulk_copy(st, xt + (size_t)c * M * 64, M * 128, FULL(s));
            for (int b = 0; b < nb; ++b) {
                bulk_copy(st + WS_W + b * 2048, wq + ((size_t)(blk0 + b) * KC + c) * 128, 2048, FULL(s));
                if (gs) {
                    const size_t rec = ((size_t)(c / GC) * NBLK + blk0 + b) * 64;
                    bulk_copy(st + WS_SZ + b * WS_REC, sc + rec, 128, FULL(s));
                    bulk_copy(st + WS_SZ + b * WS_REC + 128, zp + rec / 4, 64, FULL(s));
                }
            }
        }
        return;
    }
    const int wb = warp >> 2, tile = warp & 3, g = lane >> 2;
    if (wb >= nb) return;  // a block past N: the producer copies nothing for it and counts it out
    unsigned frA[4][4] = {}, frB[4][4] = {};  // A fragments of the chunk in flight and the next
    // one chunk from stage s (its full barrier's phase ``parity``); gs: it opens a scale group;
    // prev >= 0: the stage of the previous chunk, whose wgmmas this chunk's wait_group 1 retires
    auto run = [&](int s, unsigned parity, bool gs, int prev, unsigned (&fc)[4][4], unsigned (&fp)[4][4]) {
        const unsigned st = stages + s * WS_STAGE;
        mbar_wait(FULL(s), parity);
        Stage cur;
        cur.w[0] = lds128(st + WS_W + wb * 2048 + (tile * 32 + lane) * 16);
        if (gs) {  // this lane's rows of the (group, block) record: entries 8g + 2 * tile + r
            const unsigned sz = st + WS_SZ + wb * WS_REC, e = g * 8 + 2 * tile;
            unsigned s2, z;
            asm volatile("ld.shared.b32 %0, [%1];" : "=r"(s2) : "r"(sz + 2 * e));
            asm volatile("ld.shared.b32 %0, [%1];" : "=r"(z) : "r"(sz + 128 + 8 * g + 4 * (tile >> 1)));
            cur.s[0] = (unsigned short)(s2 & 0xFFFF);
            cur.s[1] = (unsigned short)(s2 >> 16);
            cur.z[0] = z >> (8 * (tile & 1));
        }
        compute_chunk_wg(A, cur, gs, st, fc, fp);
        // its wait_group 1 retired the previous chunk's wgmmas: that stage may be refilled
        if (prev >= 0 && lane == 0) mbar_arrive(EMPTY(prev));
    };
    auto step = [&](int j, unsigned (&fc)[4][4], unsigned (&fp)[4][4]) {
        run(j % CPA, (j / CPA) & 1, j % GC == 0, j > 0 ? (j - 1) % CPA : -1, fc, fp);
    };
#if WST && GCC && (CPA % 2 == 0) && (CPA % GCC == 0)
    // WST: trips of CPA chunks, so each chunk's stage, group position and neighbour are constants
    // (fewer issued instructions per chunk); an even count's last nloc % CPA chunks in pairs after
    if (!(nloc & 1)) {
        const int trips = nloc / CPA;
        for (int r = 0; r < trips; ++r) {
#pragma unroll
            for (int u = 0; u < CPA; u += 2) {
                run(u, r & 1, u % GCC == 0, u ? u - 1 : (r ? CPA - 1 : -1), frA, frB);
                run(u + 1, r & 1, (u + 1) % GCC == 0, u, frB, frA);
            }
        }
        for (int j = trips * CPA; j < nloc; j += 2) {
            step(j, frA, frB);
            step(j + 1, frB, frA);
        }
        wg_drain(A, frA, frB);
        return;
    }
#endif
    // two chunks per trip, so each fragment buffer is a fixed set of registers; an odd count's
    // first chunk before the loop (a conditional step inside it, ptxas serializes all wgmmas: C7513)
    if (nloc & 1) step(0, frB, frA);
    for (int j = nloc & 1; j < nloc; j += 2) {
        step(j, frA, frB);
        step(j + 1, frB, frA);
    }
    wg_drain(A, frA, frB);
#undef FULL
#undef EMPTY
}

// The CTA's WG 2 part: its mbarriers, then ws_loop over the stages, 1024-aligned from ``smem``
// (the dynamic shared memory's address; the host adds 1 KB for the alignment).
__device__ __forceinline__ void ws_gemm(Acc& A, const dt* xt, int M, const uint4* wq, const unsigned short* sc,
                                        const unsigned* zp, int KC, int NBLK, int cbeg, int nloc, int GC,
                                        unsigned smem) {
    __shared__ __align__(8) unsigned long long ws_bars[2 * CPA];
    const unsigned bars = smem_u32(ws_bars);
    const int blk0 = blockIdx.x * WS_WGS, nb = max(0, min(WS_WGS, NBLK - blk0));
    if (threadIdx.x == 0) {  // full: the producer's one arrival + the bytes; empty: each live consumer warp
        for (int s = 0; s < CPA; ++s) {
            mbar_init(bars + 8 * s, 1);
            mbar_init(bars + 8 * (CPA + s), 4 * nb);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    ws_loop(A, xt, M, wq, sc, zp, KC, NBLK, cbeg, nloc, GC, blk0, nb, (smem + 1023) & ~1023u, bars);
}

// The warp's first output row (the epilogue's nbase) from a fresh, volatile read of the block
// index: nblk and tile0 kept live from the prologue across WST's trips are what spills at 96
// registers (MINB 4: 4 CTAs per SM).
__device__ __forceinline__ int ws_nbase(int warp, int g) {
    unsigned bx;
    asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(bx));
    const int unit = (int)bx * (WARPS / KW) + warp / KW;
    return unit / (TILES_PER_BLK / TW) * 64 + (unit % (TILES_PER_BLK / TW)) * TW * 16 + g;
}
#endif

// WG 2's x tiles (w4_mma_orders.wg_x_tiles, which is the reference): out [K / 64][M][64] from x
// [M][K] (row stride ``stride_x`` elements). One thread per 16-byte unit p of (chunk c, row r):
// it holds the logical unit q = p ^ (r % 8) (the 128-byte swizzle), i.e. K positions 16i + 8s
// + 2t + h with 2i + s = q, which are x's 4-byte pairs at columns 16t + 4i + 2s (t = 0..3).
extern "C" __global__ void w4_x_tiles(const dt* __restrict__ x, int M, long long stride_x, int KC,
                                      uint4* __restrict__ out) {
    const long long u = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (u >= (long long)KC * M * 8) return;
    const int p = u & 7, r = (u >> 3) % M, c = (u >> 3) / M;
    const int q = p ^ (r & 7), i = q >> 1, s = q & 1;
    const unsigned* src = reinterpret_cast<const unsigned*>(x + (size_t)r * stride_x + (size_t)c * 64 + 4 * i + 2 * s);
    out[u] = make_uint4(__ldg(src), __ldg(src + 8), __ldg(src + 16), __ldg(src + 24));
}
