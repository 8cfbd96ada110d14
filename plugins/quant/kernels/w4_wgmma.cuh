// WG: the int4 mma kernel's MMAs as Hopper warpgroup MMAs (wgmma, sm_90a): the dequantized
// weight fragments stay the A operand in registers (the per-warp layout of wgmma's register A is
// that of mma.sync m16n8k16, so the repacked words serve both), and x, the B operand, is read
// by the tensor cores from the XR ring in shared memory through a matrix descriptor (PTX ISA,
// "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"; the register-A / shared-B split is
// the one NVIDIA's Machete mixed-input GEMM uses on Hopper). mma.sync reaches about half of
// Hopper's tensor throughput; wgmma the whole. Compiled after w4_mma_stages.cuh.
//
// A warpgroup (4 warps, TW 1, KW 1) covers one 64-row block: warp w holds tile w, rows
// 16w + g (+ 8), and its D fragments for N = 8 * NB tokens are the mma.sync accumulators
// acc[0][b][f] in the same order. The ring slot of a chunk holds B [8 * NB tokens][64 K] K-major
// with the 128-byte swizzle: token n's 128-byte row at n * 128, its 16-byte unit u at
// (u ^ (n % 8)) * 16 (slots 1024-byte aligned, so the hardware's XOR of address bits 4-6 with
// 7-9 is exactly this); K step i's descriptor starts 32 * i bytes in, groups of 8 tokens are
// SBO = 1024 bytes apart. Logical k = 16i + 8s + 2t + h of the chunk is x's column
// 16t + 4i + 2s + h (the layout's K permutation, w4_mma.cu), applied by the host beforehand.

#ifndef WG
#define WG 0
#endif
#if WG
#if !XR || TW != 1 || KW != 1 || (WARPS % 4) || !SCALE_A || (NB != 1 && NB != 2 && NB != 4 && NB != 8) || CPA < 3
#error "WG needs XR, TW 1, KW 1, WARPS a multiple of 4, SCALE_A, NB in 1, 2, 4, 8 and CPA >= 3"
#endif
#if W4_BF16
#define WG_T "bf16"
#else
#define WG_T "f16"
#endif
#define WG_SBO 1024           // 8 token rows of 128 bytes
#define WG_SLOT (NB * 1024)  // one chunk: 8 * NB token rows x 64 K x 2 bytes

// Matrix descriptor of a 128-byte-swizzled K-major tile at shared address ``addr``: start and
// SBO in 16-byte units at bits 0 and 32, LBO 1 (unused when a K step lies inside the 128-byte
// swizzle atom), base offset 0 (1024-byte aligned slots), swizzle mode 1 = 128 B (bits 62-63).
__device__ __forceinline__ unsigned long long wg_desc(unsigned addr) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(WG_SBO >> 4) << 32) |
           (1ull << 62);
}

__device__ __forceinline__ void wgmma_n8(float* d, const unsigned* a, unsigned long long desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k16.f32." WG_T "." WG_T " {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
__device__ __forceinline__ void wgmma_n16(float* d, const unsigned* a, unsigned long long desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k16.f32." WG_T "." WG_T " {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
__device__ __forceinline__ void wgmma_n32(float* d, const unsigned* a, unsigned long long desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32." WG_T "." WG_T " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
__device__ __forceinline__ void wgmma_n64(float* d, const unsigned* a, unsigned long long desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." WG_T "." WG_T " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

__device__ __forceinline__ void wgmma_step(float* d, const unsigned* a, unsigned long long desc) {
#if NB == 1
    wgmma_n8(d, a, desc);
#elif NB == 2
    wgmma_n16(d, a, desc);
#elif NB == 4
    wgmma_n32(d, a, desc);
#else
    wgmma_n64(d, a, desc);
#endif
}

// The registers an in-flight wgmma reads or writes must not be touched until its wait: these
// empty asm statements tie them to the wait, so the compiler keeps them there.
__device__ __forceinline__ void wg_pin(float& v) { asm volatile("" : "+f"(v)::"memory"); }
__device__ __forceinline__ void wg_pin(unsigned& v) { asm volatile("" : "+r"(v)::"memory"); }

// One 64-wide K chunk on the tensor cores: its 4 A fragments into ``fc``, 4 wgmmas into
// acc[0][*][*] (token-block order, as the accumulators), then a wait that leaves this group in
// flight and retires the previous chunk's, whose fragments ``fp`` may be reused after it (the pins
// keep the compiler from giving fp's registers to fc before then). ``xs``: the chunk's ring slot.
__device__ __forceinline__ void compute_chunk_wg(Acc& A, const Stage& cur, bool gstart, unsigned xs,
                                                 unsigned (&fc)[4][4], unsigned (&fp)[4][4]) {
    if (gstart) open_group(A, cur);
#pragma unroll
    for (int i = 0; i < 4; ++i) dequant_frag(fc[i], A, word_of(cur.w[0], i), 0);
    float* d = &A.acc[0][0][0];
#pragma unroll
    for (int k = 0; k < 4 * NB; ++k) wg_pin(d[k]);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    // K step i starts 32 * i bytes in: 2 * i more 16-byte units in the start field, which cannot
    // carry out of it (shared addresses < 228 KB), so one descriptor per chunk serves all four
    const unsigned long long d0 = wg_desc(xs);
#pragma unroll
    for (int i = 0; i < 4; ++i) wgmma_step(d, fc[i], d0 + 2 * i);
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
#pragma unroll
    for (int k = 0; k < 4 * NB; ++k) wg_pin(d[k]);
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) wg_pin(fp[i][j]);
}

// After the last chunk: every group retired, the accumulators final.
__device__ __forceinline__ void wg_drain(Acc& A, unsigned (&f0)[4][4], unsigned (&f1)[4][4]) {
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    float* d = &A.acc[0][0][0];
#pragma unroll
    for (int k = 0; k < 4 * NB; ++k) wg_pin(d[k]);
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            wg_pin(f0[i][j]);
            wg_pin(f1[i][j]);
        }
}

// WG's x copy: the host passes x with each 64-column chunk already in the layout's K order
// (``w4_mma_orders.chunk_k_order``: position 16i + 8s + 2t + h holds column 16t + 4i + 2s + h), so
// a token's chunk is B's 128-byte row as it stands, and cp.async moves its 16-byte units straight
// to their swizzled places, as deep ahead as the weights (no register staging, no 4-byte stores).
__device__ __forceinline__ void issue_x_wg(unsigned slot, const dt* x, int M, long long stride_x, int c) {
    for (int u = threadIdx.x; u < M * 8; u += NT) {
        const int row = u >> 3, unit = u & 7;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(slot + row * 128 + ((unit ^ (row & 7)) << 4)),
                     "l"(x + (size_t)row * stride_x + (size_t)c * 64 + unit * 8)
                     : "memory");
    }
}
#endif
