// Probe (benchmarks/w4_ss_probe.py; not a shipped kernel): W4A16 at M <= 64 with wgmma's roles
// swapped against WG / WG 2. x (64 token rows, w4_x_tiles' tiles) is wgmma's A, read from shared
// memory; the consumer warpgroup dequantizes PBN 64-row blocks of weights into a 128-byte-swizzled
// [64 PBN rows][64 K] tile that is B, so one wgmma is m64n(64 PBN)k16 with both operands in shared
// memory (SS) instead of m64n(8 NB)k16 with the weights in registers (RS). A producer warp's bulk
// copies fill PCPA stages of PCH chunks (x, each block's weight words, scales and zeros), guarded
// by full / empty mbarriers as in WG 2. Split K writes fp32 partials ws[split][M][N] (summed by
// the host). Leave-outs for timing: LO_LD (no copies), LO_DQ (no stores of B), LO_MMA (no wgmmas),
// LO_FENCE (no proxy fence before the wgmmas).
// Appended to w4_mma_jit.SOURCE compiled as a WG 2 config, whose helpers it uses (mbar_*,
// bulk_copy, wg_desc, wg_pin, pair_bits, fma2); the placeholder line below is the host's wgmma_ss for N = 64 PBN.
#ifndef LO_LD
#define LO_LD 0
#endif
#ifndef LO_DQ
#define LO_DQ 0
#endif
#ifndef LO_MMA
#define LO_MMA 0
#endif
#ifndef LO_FENCE
#define LO_FENCE 0
#endif
#ifndef PCH
#define PCH 1  // chunks per stage (one bulk copy of x, one per block)
#endif
#define SS_XC (PCH * 8192)      // x: PCH chunk tiles of M rows (read as 64) x 128 B
#define SS_W SS_XC              // then PBN x PCH x 2 KB of weight words
#define SS_SZ (SS_W + PBN * PCH * 2048)  // then PCH slots of PBN x 128 B scales + PBN x 64 B zero points
#define SS_REC 192                       // (the layout's group records: w4_mma.cu)
#define SS_STAGE ((SS_SZ + PCH * PBN * SS_REC + 1023) & ~1023)
#define SS_BBUF (PBN * 8192)    // one chunk's dequantized B: 64 PBN rows x 128 B

@WGMMA_SS@

extern "C" __global__ void __launch_bounds__(160, 1)
w4_ss_probe(const dt* __restrict__ xt, int M, const uint4* __restrict__ wq, const unsigned short* __restrict__ sc,
        const unsigned* __restrict__ zp, int KC, int NBLK, int GC, int cps, float* __restrict__ ws, int N) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ __align__(8) unsigned long long bars_raw[2 * PCPA];
    const unsigned base = (smem_u32(smem_raw) + 1023) & ~1023u;
    const unsigned stages = base, bbuf = base + PCPA * SS_STAGE, bars = smem_u32(bars_raw);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int blk0 = blockIdx.x * PBN, cbeg = blockIdx.y * cps, nloc = min(cps, KC - cbeg);
#define FULL(s) (bars + 8 * (s))
#define EMPTY(s) (bars + 8 * (PCPA + (s)))
    if (threadIdx.x == 0) {
        for (int s = 0; s < PCPA; ++s) { mbar_init(FULL(s), 1); mbar_init(EMPTY(s), 4); }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (warp == 4) {  // the producer
        if (lane == 0)
            for (int j = 0; j < nloc / PCH; ++j) {  // stage j: chunks cbeg + PCH j ..
                const int s = j % PCPA, c0 = cbeg + j * PCH;
                if (j >= PCPA) mbar_wait(EMPTY(s), (j / PCPA - 1) & 1);
                int ng = 0;
                for (int q = 0; q < PCH; ++q) ng += (c0 + q - cbeg) % GC == 0;
                const unsigned st = stages + s * SS_STAGE;
#if LO_LD  // leave-out: no loads (the stage holds whatever it held)
                mbar_arrive(FULL(s));
                continue;
#endif
                mbar_expect_tx(FULL(s), PCH * M * 128 + PBN * PCH * 2048 + ng * PBN * SS_REC);
                bulk_copy(st, xt + (size_t)c0 * M * 64, PCH * M * 128, FULL(s));
                for (int b = 0; b < PBN; ++b)
                    bulk_copy(st + SS_W + b * PCH * 2048, wq + ((size_t)(blk0 + b) * KC + c0) * 128, PCH * 2048, FULL(s));
                for (int q = 0; q < PCH; ++q)
                    if ((c0 + q - cbeg) % GC == 0) {
                        const size_t rec = ((size_t)((c0 + q) / GC) * NBLK + blk0) * 64;
                        bulk_copy(st + SS_SZ + q * PBN * SS_REC, sc + rec, PBN * 128, FULL(s));
                        bulk_copy(st + SS_SZ + q * PBN * SS_REC + PBN * 128, zp + rec / 4, PBN * 64, FULL(s));
                    }
            }
        return;
    }
    const int g = lane >> 2, t = lane & 3;
    float d[32 * PBN];  // no zero fill (ptxas would serialize the wgmmas, C7515): chunk 0's first one scales D by 0
    unsigned zb[PBN][2], sa[PBN][2];
    for (int j = 0; j < nloc; ++j) {
        const int s = (j / PCH) % PCPA, q = j % PCH;
        const unsigned st = stages + s * SS_STAGE, bb = bbuf + (j & 1) * SS_BBUF, xs = st + q * M * 128;
        if (q == 0) mbar_wait(FULL(s), (j / PCH / PCPA) & 1);
        if (j % GC == 0) {
#pragma unroll
            for (int b = 0; b < PBN; ++b) {
                const unsigned e = g * 8 + 2 * warp;
                unsigned s2, z;
                asm volatile("ld.shared.b32 %0, [%1];" : "=r"(s2) : "r"(st + SS_SZ + q * PBN * SS_REC + b * 128 + 2 * e));
                asm volatile("ld.shared.b32 %0, [%1];"
                             : "=r"(z) : "r"(st + SS_SZ + q * PBN * SS_REC + PBN * 128 + b * 64 + 8 * g + 4 * (warp >> 1)));
                z >>= 8 * (warp & 1);  // this tile's two zero points at bits 0-3 / 4-7 of both halves
                zb[b][0] = and_or<0x000f000fu>(z, NEG_LO2);
#if HI_IN_PLACE
                zb[b][1] = and_or<0x00f000f0u>(z, NEG_HI2);
#else
                zb[b][1] = and_or<0x000f000fu>(z >> 4, NEG_LO2);
#endif
                sa[b][0] = dup2(f_to_dt(h16_to_f((unsigned short)(s2 & 0xFFFF))));
                sa[b][1] = dup2(f_to_dt(h16_to_f((unsigned short)(s2 >> 16))));
            }
        }
        // B buffer j & 1 was last read by chunk j - 2, retired by the previous wait_group 1
#pragma unroll
        for (int b = 0; b < PBN; ++b) {
            const uint4 wv = lds128(st + SS_W + (b * PCH + q) * 2048 + (warp * 32 + lane) * 16);
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
#if HI_IN_PLACE
                    unsigned v = fma2(pair_bits(word_of(wv, i), r), (r & 1) ? SIXTEENTH2 : ONE2, zb[b][r & 1]);
#else
                    unsigned v = fma2(pair_bits(word_of(wv, i), r), ONE2, zb[b][r & 1]);
#endif
                    v = fma2(v, sa[b][r & 1], NEG_ZERO2);
                    const unsigned n = 64 * b + 16 * warp + g + 8 * (r & 1);
                    const unsigned u = 2 * i + (r >> 1);
#if !LO_DQ
                    asm volatile("st.shared.b32 [%0], %1;" ::"r"(bb + n * 128 + ((u ^ g) << 4) + 4 * t), "r"(v) : "memory");
#else
                    if (v == 0x12345678u) asm volatile("st.shared.b32 [%0], %1;" ::"r"(bb), "r"(v) : "memory");
#endif
                }
        }
#if !LO_FENCE
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
        asm volatile("bar.sync 1, 128;" ::: "memory");  // the consumer warpgroup's B is complete
#pragma unroll
        for (int k = 0; k < 32 * PBN; ++k) wg_pin(d[k]);
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
        for (int i = 0; i < 4; ++i)
            if (!LO_MMA) wgmma_ss(d, wg_desc(xs + 32 * i), wg_desc(bb + 32 * i), j > 0 || i > 0);
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
#pragma unroll
        for (int k = 0; k < 32 * PBN; ++k) wg_pin(d[k]);
        // chunk j - 1's wgmmas retired: if it closed a stage, the producer may refill that stage
        if (j > 0 && q == 0 && lane == 0) mbar_arrive(EMPTY((j / PCH - 1) % PCPA));
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
    for (int k = 0; k < 32 * PBN; ++k) wg_pin(d[k]);
    // D: row (token) 16 warp + g (+ 8), columns 8 q + 2 t (+ 1) of the tile
    float* out = ws + (size_t)blockIdx.y * M * N + (size_t)blk0 * 64;
#pragma unroll
    for (int q = 0; q < 8 * PBN; ++q)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = 16 * warp + g + 8 * h;
            if (row < M)
                *reinterpret_cast<float2*>(out + (size_t)row * N + 8 * q + 2 * t) = make_float2(d[4 * q + 2 * h], d[4 * q + 2 * h + 1]);
        }
}
