// flash_decode: split-KV paged decode attention (Flash-Decoding, Dao et al. 2023;
// FlashInfer's split-KV + merge-states design, Ye et al. 2025), compiled at run time by NVRTC.
//
// Compile-time constants (passed as -D options): KV_DTYPE (0 fp16, 1 bf16, 2 fp32),
// HEAD_DIM (8, 16 or a multiple of 32 up to 256; fp32 up to 128), GROUP (query heads per
// KV head), HEADS (query heads served by one program: GROUP, or about half of it when
// GROUP > 8, see jit.py), BLOCK_SIZE (tokens per KV block: 8, 16 or 32).
//
// Layouts: q/out rows [*, Hq, D] (row stride given), cache [2, NB, BS, Hkv, D],
// block_table int32 [B, max_blocks], seq_lens int32 [B].
//
// fd_partial: one program (CUDA block of 4 warps) = (KV head, head slice, split, decode row).
//   * Keys are spread over lanes: a "key group" of LPK lanes holds one key; lane r of the
//     group owns the 16-byte vectors r, r + LPK, ... (VPL of them) of the key's row, so a
//     warp works on KPW = 32 / LPK keys at once and q.k needs only log2(LPK) shuffles
//     (bf16 head_dim 128, <= 4 heads: 8 lanes x 2 vectors, 4 keys per warp).
//   * Each thread keeps the q slices (its dims) of all HEADS query heads in registers, so a
//     K/V vector read once from HBM serves the whole GQA group; its V slice (same dims) is
//     accumulated for every head, and at the end lanes holding the same dims are summed.
//   * K/V go global -> shared memory with cp.async (16 bytes, zero-filled past the end),
//     STAGES deep. Each thread copies exactly the vectors it later reads, so a stage needs
//     only the thread's own cp.async.wait_group, no barrier. Chosen over plain register
//     loads because copies in flight cost no registers: 3 stages per thread stay in flight
//     while one is computed (24 KB per program, ~72 KB per SM), and the registers go to q
//     and the accumulators (2 x HEADS x EPL floats) instead.
//   * Online softmax per key group in base 2 (scale * log2(e) folded into q). The running
//     max m is a reference, not the exact max: the accumulators are rescaled (a branch)
//     only when a score passes m + RESCALE_SLACK, so p = exp2(s - m) <= 2^8 and after the
//     first keys the branch is hardly ever taken (FlashAttention-4's conditional rescale);
//     l and acc stay consistent with m, so the result is exact.
//   * At the end the key groups of a warp are combined by shuffles, the 4 warps through
//     shared memory (reusing the ring), and the program writes the output (one split) or
//     its partial state (part_out fp32 [rows, Hq, splits, D], part_lse = natural-log sum
//     of exp; an empty split writes only part_lse = -inf).
// fd_merge: one program per (query head, row) combines the splits by log-sum-exp weights.
// emulate.py mirrors both kernels' indexing on the CPU (numpy); keep the two in step.
// Source: fd_common.cuh (types, constants, helpers), then this file, joined by jit.SOURCE.

extern "C" __global__ void __launch_bounds__(NTHREADS, MIN_PROGRAMS)
fd_partial(const st* __restrict__ q, long long q_row_stride,
           const st* __restrict__ kv, long long kv_half,              // elements in K (= in V)
           const int* __restrict__ block_table, int max_blocks,
           const int* __restrict__ seq_lens,
           const int* __restrict__ row_tok, const int* __restrict__ row_req,
           int num_kv_heads, int partition, int num_splits, float scale,
           float* __restrict__ part_out, float* __restrict__ part_lse,
           st* __restrict__ out, long long out_row_stride) {
    __shared__ __align__(16) unsigned char smem[SMEM_BYTES];
    // KV head fastest: programs running together read all heads of the same tokens
    // (whole cache rows), and the head slices of one KV head share its K/V through L2.
    const int hk = blockIdx.x / HSLICES, hs = blockIdx.x % HSLICES;
    const int split = blockIdx.y, row = blockIdx.z;
    const int tid = threadIdx.x, warp = tid / WARP, lane = tid % WARP;
    const int g = lane / LPK, r = lane % LPK;                  // key group in the warp, lane in the group
    const int tok = row_tok[row], req = row_req[row];
    const int seq_len = seq_lens[req];
    const int num_heads = num_kv_heads * GROUP;
    const int head0 = hk * GROUP + hs * GH;                    // first query head of this program
    const int nh = min(GH, GROUP - hs * GH);                   // real heads (the rest is padding)
    // q before the empty-split test: its load then overlaps the seq_lens one.
    float qf[GH][EPL];
    {
        const st* qp = q + (long long)tok * q_row_stride + (long long)head0 * HEAD_DIM;
        const float qs = scale * LOG2E;  // scores in base 2: exp2 below
#pragma unroll
        for (int h = 0; h < GH; ++h)
#pragma unroll
            for (int j = 0; j < VPL; ++j)
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    float x = 0.f;
                    if (h < nh && owns(r, j)) x = to_f(qp[h * HEAD_DIM + (r + j * LPK) * VEC + e]) * qs;
                    qf[h][j * VEC + e] = x;
                }
    }
    const int start = split * partition;                       // a multiple of BLOCK_SIZE
    const int end = min(start + partition, seq_len);
    if (start >= end) {  // an empty split: neutral element for the merge
        if (num_splits > 1 && tid < nh)
            part_lse[((long long)row * num_heads + head0 + tid) * num_splits + split] = NEG_INF;
        return;
    }

    // Running max starts at -FLT_MAX, not -inf: exp2(s - m) and exp2(m - m') then never see
    // -inf - -inf (NaN), and a key group or warp without any valid key keeps l = acc = 0.
    float m[GH], l[GH], acc[GH][EPL];
#pragma unroll
    for (int h = 0; h < GH; ++h) {
        m[h] = -FLT_MAX_;
        l[h] = 0.f;
#pragma unroll
        for (int e = 0; e < EPL; ++e) acc[h][e] = 0.f;
    }

    const int* bt = block_table + (long long)req * max_blocks;
    const int tok_stride = num_kv_heads * HEAD_DIM;           // elements between tokens of a block
    const int blk_stride = BLOCK_SIZE * tok_stride;            // elements between cache blocks
    // This lane's first vector of K in slot 0 (a padding lane points at the row's first one).
    const st* kvh = kv + hk * HEAD_DIM + ((NV == LPK * VPL || r < NV) ? r * VEC : 0);
    uint4 (*ring)[UNROLL][2][VPL][NTHREADS] = reinterpret_cast<uint4 (*)[UNROLL][2][VPL][NTHREADS]>(smem);
    const unsigned int ring_addr = smem_addr(&ring[0][0][0][0][tid]);
    // Stage t: this thread's keys are start + t * PKEYS + my_key + u, u < UNROLL (one KV block).
    const int my_key = warp * WKEYS + g * UNROLL;

    // Block-table entry of the keys starting at key0 (0 past the end: then nothing is read).
    auto lookup = [&](int key0) -> unsigned int {
        return key0 < end ? (unsigned int)bt[(unsigned int)key0 / BLOCK_SIZE] : 0u;
    };
    auto issue = [&](int t, int key0, unsigned int blk) {
        // In bounds even past the end (a slot of block blk, or of block 0 when the stage is
        // wholly past it); such copies read nothing anyway (bytes 0: zero-fill).
        const st* src = kvh + (unsigned long long)blk * (unsigned int)blk_stride
                        + ((unsigned int)key0 % BLOCK_SIZE) * (unsigned int)tok_stride;
        const int slot = t & (STAGES - 1);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
            for (int c = 0; c < 2; ++c)
#pragma unroll
                for (int j = 0; j < VPL; ++j) {
                    const bool ok = key0 + u < end && owns(r, j);
                    const int idx = ((slot * UNROLL + u) * 2 + c) * VPL + j;  // &ring[slot][u][c][j][tid]
                    const int vo = owns(r, j) ? j * LPK * VEC : 0;           // a padding lane stays in the row
                    cp_async16(ring_addr + idx * (NTHREADS * 16), &ring[slot][u][c][j][tid],
                               src + (c ? kv_half : 0) + u * tok_stride + vo, ok ? 16 : 0);
                }
    };

    // Prologue: STAGES - 1 stages in flight; block-table entries are fetched one stage
    // ahead of their use so the copy issue never waits on them.
    int key_issue = start + my_key;                            // key0 of the next stage to issue
    unsigned int blk = lookup(key_issue);
#pragma unroll
    for (int t = 0; t < STAGES - 1; ++t) {
        const unsigned int nb = lookup(key_issue + PKEYS);
        issue(t, key_issue, blk);
        cp_async_commit();
        blk = nb;
        key_issue += PKEYS;
    }

    int key0 = start + my_key;                                 // this thread's first key of stage t
    for (int t = 0; key0 - g * UNROLL < end; ++t, key0 += PKEYS) {  // warp's first key: warp-uniform
        {
            const unsigned int nb = lookup(key_issue + PKEYS);
            issue(t + STAGES - 1, key_issue, blk);  // into the slot read in iteration t - 1
            cp_async_commit();
            blk = nb;
            key_issue += PKEYS;
        }
        cp_async_wait<STAGES - 1>();     // this thread's copies of stage t have landed
        const int slot = t & (STAGES - 1);

        float s[UNROLL][GH];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            float kf[EPL];
#pragma unroll
            for (int j = 0; j < VPL; ++j) {
                const uint4 w = owns(r, j) ? ring[slot][u][0][j][tid] : make_uint4(0, 0, 0, 0);
                unpack(w, kf + j * VEC);
            }
#pragma unroll
            for (int h = 0; h < GH; ++h) {
                float a[VPL];  // one FMA chain per vector, for instruction-level parallelism
#pragma unroll
                for (int j = 0; j < VPL; ++j) {
                    a[j] = 0.f;
#pragma unroll
                    for (int e = 0; e < VEC; ++e) a[j] = fmaf(qf[h][j * VEC + e], kf[j * VEC + e], a[j]);
                }
                float x = a[0];
#pragma unroll
                for (int j = 1; j < VPL; ++j) x += a[j];
                s[u][h] = x;
            }
        }
        // Sum over the key group's lanes: every lane of the group gets the same score.
#pragma unroll
        for (int o = 1; o < LPK; o <<= 1)
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
#pragma unroll
                for (int h = 0; h < GH; ++h) s[u][h] += __shfl_xor_sync(FULL_MASK, s[u][h], o);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
            if (key0 + u >= end)
#pragma unroll
                for (int h = 0; h < GH; ++h) s[u][h] = NEG_INF;

        // Reference max per key group; one branch for all heads so it stays a jump.
        float cm[GH];
        bool grow = false;
#pragma unroll
        for (int h = 0; h < GH; ++h) {
            cm[h] = s[0][h];
#pragma unroll
            for (int u = 1; u < UNROLL; ++u) cm[h] = fmaxf(cm[h], s[u][h]);
            grow |= cm[h] > m[h] + RESCALE_SLACK;  // -FLT_MAX + 8 == -FLT_MAX: the first key grows
        }
        if (grow) {  // then this stage has a valid key: every cm is finite
#pragma unroll
            for (int h = 0; h < GH; ++h) {
                const float mn = fmaxf(m[h], cm[h]);
                const float alpha = exp2f(m[h] - mn);  // 0 after -FLT_MAX
                m[h] = mn;
                l[h] *= alpha;
#pragma unroll
                for (int e = 0; e < EPL; ++e) acc[h][e] *= alpha;
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            float vf[EPL];
#pragma unroll
            for (int j = 0; j < VPL; ++j) {
                const uint4 w = owns(r, j) ? ring[slot][u][1][j][tid] : make_uint4(0, 0, 0, 0);
                unpack(w, vf + j * VEC);
            }
#pragma unroll
            for (int h = 0; h < GH; ++h) {
                const float p = exp2f(s[u][h] - m[h]);  // 0 for a masked key (whose V is zero-filled)
                l[h] += p;
#pragma unroll
                for (int e = 0; e < EPL; ++e) acc[h][e] = fmaf(p, vf[e], acc[h][e]);
            }
        }
    }
    cp_async_wait<0>();  // zero-fill copies past the end may still be pending: the ring is reused below

    // Key groups -> warp: rescale to the warp's max, then add the lanes holding the same dims.
#pragma unroll
    for (int h = 0; h < GH; ++h) {
        float mw = m[h];
#pragma unroll
        for (int o = LPK; o < WARP; o <<= 1) mw = fmaxf(mw, __shfl_xor_sync(FULL_MASK, mw, o));
        const float sc = exp2f(m[h] - mw);  // a group without keys has l = acc = 0 anyway
        float lh = l[h] * sc;
#pragma unroll
        for (int o = LPK; o < WARP; o <<= 1) lh += __shfl_xor_sync(FULL_MASK, lh, o);
#pragma unroll
        for (int e = 0; e < EPL; ++e) {
            float a = acc[h][e] * sc;
#pragma unroll
            for (int o = LPK; o < WARP; o <<= 1) a += __shfl_xor_sync(FULL_MASK, a, o);
            acc[h][e] = a;
        }
        m[h] = mw;
        l[h] = lh;
    }

    // Warps -> program, through shared memory (the ring is free once every warp is here).
    __syncthreads();
    float* cmax = reinterpret_cast<float*>(smem);   // [NWARPS][GH]
    float* csum = cmax + NWARPS * GH;               // [NWARPS][GH]
    float* cacc = csum + NWARPS * GH;               // [NWARPS][GH][HEAD_DIM]
    if (lane == 0) {
#pragma unroll
        for (int h = 0; h < GH; ++h) {
            cmax[warp * GH + h] = m[h];
            csum[warp * GH + h] = l[h];
        }
    }
    if (lane < LPK) {
#pragma unroll
        for (int h = 0; h < GH; ++h)
#pragma unroll
            for (int j = 0; j < VPL; ++j)
                if (owns(r, j))
#pragma unroll
                    for (int e = 0; e < VEC; ++e)
                        cacc[(warp * GH + h) * HEAD_DIM + (r + j * LPK) * VEC + e] = acc[h][j * VEC + e];
    }
    __syncthreads();
    for (int i = tid; i < nh * HEAD_DIM; i += NTHREADS) {
        const int h = i / HEAD_DIM, d = i % HEAD_DIM;
        float mx = NEG_INF;
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) mx = fmaxf(mx, cmax[w * GH + h]);  // a real max: warp 0 has key `start`
        float den = 0.f, num = 0.f;
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) {
            const float sc = exp2f(cmax[w * GH + h] - mx);  // a warp without keys has l = acc = 0
            den += csum[w * GH + h] * sc;
            num += cacc[(w * GH + h) * HEAD_DIM + d] * sc;
        }
        const float o = num / den;
        if (num_splits == 1) {
            out[(long long)tok * out_row_stride + (long long)(head0 + h) * HEAD_DIM + d] = from_f(o);
        } else {
            const long long pidx = ((long long)row * num_heads + head0 + h) * num_splits + split;
            part_out[pidx * HEAD_DIM + d] = o;
            if (d == 0) part_lse[pidx] = (mx + log2f(den)) * LN2;
        }
    }
}

#define MERGE_WARPS 8

// Merge the splits of one (row, head) by log-sum-exp weights (FlashInfer's merge_states).
// Warps take splits round-robin, each lane a float4 of the row, so many rows are in flight.
// Lanes past the row (f >= NF4) load a clamped copy and store nothing. (min blocks 1: ptxas
// then keeps a round's loads together instead of trading them for registers.)
extern "C" __global__ void __launch_bounds__(MERGE_WARPS * WARP, 1)
fd_merge(const float* __restrict__ part_out, const float* __restrict__ part_lse,
         const int* __restrict__ row_tok, int num_heads, int num_splits,
         st* __restrict__ out, long long out_row_stride) {
    constexpr int NF4 = HEAD_DIM / 4;                 // float4 per row
    constexpr int F4L = (NF4 + WARP - 1) / WARP;      // float4 per lane
    __shared__ float red[MERGE_WARPS][HEAD_DIM];
    __shared__ float red_den[MERGE_WARPS], red_max[MERGE_WARPS];
    const int head = blockIdx.x, row = blockIdx.y;
    const int tid = threadIdx.x, warp = tid / WARP, lane = tid % WARP;
    const long long base = ((long long)row * num_heads + head) * num_splits;

    float mx = NEG_INF;
    for (int s = tid; s < num_splits; s += MERGE_WARPS * WARP) mx = fmaxf(mx, part_lse[base + s]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, o));
    if (lane == 0) red_max[warp] = mx;
    __syncthreads();
    mx = red_max[0];
#pragma unroll
    for (int w = 1; w < MERGE_WARPS; ++w) mx = fmaxf(mx, red_max[w]);

    float4 a[F4L];
#pragma unroll
    for (int i = 0; i < F4L; ++i) a[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    float den = 0.f;
    // MB splits per warp per round, all loaded before any is used: batch 1 has only Hq merge
    // programs, so rounds of memory latency, not bandwidth, set the time.
    constexpr int MB = 8;
    for (int s0 = warp; s0 < num_splits; s0 += MERGE_WARPS * MB) {
        float lse[MB];
        float4 x[MB][F4L];
        float w[MB];
#pragma unroll
        for (int b = 0; b < MB; ++b) {  // unpredicated loads (split index clamped) batch best
            const int s = min(s0 + b * MERGE_WARPS, num_splits - 1);
            lse[b] = part_lse[base + s];
            const float4* p = reinterpret_cast<const float4*>(part_out + (base + s) * HEAD_DIM);
#pragma unroll
            for (int i = 0; i < F4L; ++i) x[b][i] = p[min(lane + i * WARP, NF4 - 1)];
        }
#pragma unroll
        for (int b = 0; b < MB; ++b) {
            // An empty split (lse -inf) never wrote its row, which may hold anything: weight 0, not 0 * x.
            const bool live = s0 + b * MERGE_WARPS < num_splits && lse[b] != NEG_INF;
            w[b] = live ? __expf(lse[b] - mx) : 0.f;
        }
#pragma unroll
        for (int b = 0; b < MB; ++b) {
            const bool live = w[b] > 0.f;  // (0 also for a live split whose weight underflows: it adds nothing)
            den += w[b];
#pragma unroll
            for (int i = 0; i < F4L; ++i) {
                a[i].x += live ? w[b] * x[b][i].x : 0.f;
                a[i].y += live ? w[b] * x[b][i].y : 0.f;
                a[i].z += live ? w[b] * x[b][i].z : 0.f;
                a[i].w += live ? w[b] * x[b][i].w : 0.f;
            }
        }
    }
#pragma unroll
    for (int i = 0; i < F4L; ++i) {
        const int f = lane + i * WARP;
        if (f < NF4) {
            red[warp][4 * f] = a[i].x;
            red[warp][4 * f + 1] = a[i].y;
            red[warp][4 * f + 2] = a[i].z;
            red[warp][4 * f + 3] = a[i].w;
        }
    }
    if (lane == 0) red_den[warp] = den;
    __syncthreads();
    float dsum = 0.f;
#pragma unroll
    for (int w = 0; w < MERGE_WARPS; ++w) dsum += red_den[w];
    st* op = out + (long long)row_tok[row] * out_row_stride + (long long)head * HEAD_DIM;
    for (int d = tid; d < HEAD_DIM; d += MERGE_WARPS * WARP) {
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < MERGE_WARPS; ++w) v += red[w][d];
        op[d] = from_f(dsum > 0.f ? v / dsum : 0.f);  // dsum 0 only if every split was empty
    }
}
