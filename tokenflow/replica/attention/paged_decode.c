/* Paged decode attention on the CPU, float32: each decoding request's one query attends over
 * its context where it lies in the paged KV cache, through its block table row. No gather copy,
 * no padding, no mask: keys are read in place, once per KV head for all of its query heads.
 *
 * Decode attention is bound by memory: every step reads each request's whole K/V once. So a
 * task reads a token's row of all its KV heads together (contiguous inside a block, so the
 * hardware prefetcher streams whole blocks), in tiles of TILE tokens with an online softmax
 * (no per-task buffer sized by the context), and the dot products of a tile are independent
 * chains (out-of-order execution overlaps them with the loads).
 *
 * Built by tokenflow/replica/attention/cpu_kernel.py (cc -O3 -march=native -fopenmp
 * -ffp-contract=fast); loaded after torch, so OpenMP is torch's own runtime (one thread pool,
 * not two spinning ones).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Query heads per KV head this kernel handles on the stack (more: the torch backend). */
#define MAX_GROUP 16
/* Query heads one task holds on the stack when it takes all of a request's KV heads. */
#define MAX_HEADS 32
/* Largest head_dim handled on the stack. */
#define MAX_HEAD_DIM 256
/* Tokens per tile of the online softmax. */
#define TILE 32
/* Floats in a 64-byte cache line: the prefetch's stride. */
#define FLOATS_PER_LINE 16
/* Requests from which on a task takes all KV heads of its request (fewer: one KV head per
 * task, so that a step of one or two decodes still spreads over the cores). */
#define WHOLE_REQUEST_TASKS 8

/* GCC/Clang vector extensions: the machine's widest float vector under -march=native. */
#ifdef __AVX512F__
#define VW 16
#else
#define VW 8
#endif
typedef float vec __attribute__((vector_size(VW * sizeof(float))));
typedef float vec8 __attribute__((vector_size(8 * sizeof(float))));
typedef float vec4 __attribute__((vector_size(4 * sizeof(float))));

static inline vec load(const float *p) {
    vec x;
    memcpy(&x, p, sizeof x); /* an unaligned vector load */
    return x;
}

static inline void store(float *p, vec x) { memcpy(p, &x, sizeof x); }

static inline float horizontal_sum(vec s) {
#if VW == 16
    const vec8 a = __builtin_shufflevector(s, s, 0, 1, 2, 3, 4, 5, 6, 7)
                   + __builtin_shufflevector(s, s, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    const vec8 a = s;
#endif
    const vec4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3)
                   + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* e^x for x <= 0 (a score minus its running maximum), within ~2 ulp: 2^n * e^r with
 * |r| <= ln2 / 2 and a degree-6 polynomial. Inline arithmetic (floor, not libm's roundf), so
 * the loop over a tile's scores vectorizes. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = __builtin_floorf(x * 1.44269504f + 0.5f);
    const float r = x - n * 0.693145752f - n * 1.42860677e-6f;
    float p = 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { float f; int32_t i; } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

static inline float dot(const float *a, const float *b, int64_t dim) {
    vec s = {0};
    int64_t d = 0;
    for (; d + VW <= dim; d += VW) s += load(a + d) * load(b + d);
    float total = horizontal_sum(s);
    for (; d < dim; ++d) total += a[d] * b[d];
    return total;
}

/* acc[0, dim) += sum over i < n of p[i] * (rows[i] + off)[0, dim); four vectors of acc stay in
 * registers across the tile's rows. */
static inline void add_weighted_rows(float *acc, const float *p, const float *const *rows,
                                     int64_t off, int64_t n, int64_t dim) {
    int64_t d = 0;
    for (; d + 4 * VW <= dim; d += 4 * VW) {
        vec a0 = load(acc + d), a1 = load(acc + d + VW), a2 = load(acc + d + 2 * VW),
            a3 = load(acc + d + 3 * VW);
        for (int64_t i = 0; i < n; ++i) {
            const float *row = rows[i] + off + d;
            const float w = p[i];
            a0 += w * load(row);
            a1 += w * load(row + VW);
            a2 += w * load(row + 2 * VW);
            a3 += w * load(row + 3 * VW);
        }
        store(acc + d, a0);
        store(acc + d + VW, a1);
        store(acc + d + 2 * VW, a2);
        store(acc + d + 3 * VW, a3);
    }
    for (; d + VW <= dim; d += VW) {
        vec a = load(acc + d);
        for (int64_t i = 0; i < n; ++i) a += p[i] * load(rows[i] + off + d);
        store(acc + d, a);
    }
    for (; d < dim; ++d) {
        float a = acc[d];
        for (int64_t i = 0; i < n; ++i) a += p[i] * rows[i][off + d];
        acc[d] = a;
    }
}

/* First the step's new keys and values go to their slots (new_k/new_v [T, KVH, D] with
 * strides (k_tok, k_head, 1) and (v_tok, v_head, 1); slots [T] int64 flat slot ids); then out[t, h, :] for
 * t = token_idx[r] of each decode r: softmax(scale * q . K) V over the request's keys
 * [max(0, seq - window), seq) (window 0: all).
 *   q        [T, H, D] with strides (q_tok, q_head, 1)
 *   k, v     [blocks, block_size, KVH, D] contiguous (one layer's half of the cache)
 *   table    [num_decodes, table_stride] int32 block ids
 *   out      [T, H, D] contiguous
 * Returns 0, or -1 when the shapes are beyond the stack buffers (nothing written). */
int paged_decode_f32(const float *new_k, int64_t k_tok, int64_t k_head, const float *new_v,
                     int64_t v_tok, int64_t v_head, const int64_t *slots, int64_t num_tokens,
                     const float *q, int64_t q_tok, int64_t q_head, float *k,
                     float *v, const int32_t *table, int64_t table_stride,
                     const int32_t *seq_lens, const int64_t *token_idx, int64_t num_decodes,
                     int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                     int64_t block_size, int64_t window, float scale, float *out) {
    const int64_t group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || group * num_kv_heads != num_heads)
        return -1;
    const int64_t row = num_kv_heads * head_dim; /* floats between two tokens of a block */
    for (int64_t t = 0; t < num_tokens; ++t)
        for (int64_t g = 0; g < num_kv_heads; ++g) {
            const int64_t at = slots[t] * row + g * head_dim;
            memcpy(k + at, new_k + t * k_tok + g * k_head, sizeof(float) * (size_t)head_dim);
            memcpy(v + at, new_v + t * v_tok + g * v_head, sizeof(float) * (size_t)head_dim);
        }
    const int64_t kv_per_task =
        num_decodes >= WHOLE_REQUEST_TASKS && num_heads <= MAX_HEADS ? num_kv_heads : 1;
    const int64_t tasks_per_request = num_kv_heads / kv_per_task;
    const int64_t tasks = num_decodes * tasks_per_request;
#pragma omp parallel for schedule(dynamic, 1) if (tasks > 1)
    for (int64_t task = 0; task < tasks; ++task) {
        const int64_t r = task / tasks_per_request;
        const int64_t g0 = (task % tasks_per_request) * kv_per_task; /* first KV head */
        const int64_t heads = kv_per_task * group;                    /* query heads */
        const int64_t seq = seq_lens[r];
        const int64_t first = (window > 0 && seq > window) ? seq - window : 0;
        const int32_t *blocks = table + r * table_stride;
        const int64_t span = kv_per_task * head_dim; /* floats of a row this task reads */
        const float *qr = q + token_idx[r] * q_tok + g0 * group * q_head;
        float qs[MAX_HEADS][MAX_HEAD_DIM], acc[MAX_HEADS][MAX_HEAD_DIM];
        float top[MAX_HEADS], total[MAX_HEADS], p[TILE];
        const float *krow[TILE], *vrow[TILE];
        for (int64_t j = 0; j < heads; ++j) {
            for (int64_t d = 0; d < head_dim; ++d) qs[j][d] = qr[j * q_head + d] * scale;
            for (int64_t d = 0; d < head_dim; ++d) acc[j][d] = 0.0f;
            top[j] = -INFINITY;
            total[j] = 0.0f;
        }
        for (int64_t t0 = first; t0 < seq; t0 += TILE) {
            const int64_t n = seq - t0 < TILE ? seq - t0 : TILE;
            for (int64_t i = 0; i < n; ++i) {
                const int64_t pos = t0 + i;
                const int64_t at = ((int64_t)blocks[pos / block_size] * block_size
                                    + pos % block_size) * row + g0 * head_dim;
                krow[i] = k + at;
                vrow[i] = v + at;
            }
            /* The next tile's rows are fetched while this one computes: a request's blocks lie
             * anywhere in the cache, so the hardware prefetcher loses the stream at each
             * block's end, and the step is bound by reading the cache from memory. */
            const int64_t next_end = seq - (t0 + TILE) < TILE ? seq : t0 + 2 * TILE;
            for (int64_t pos = t0 + TILE; pos < next_end; ++pos) {
                const int64_t at = ((int64_t)blocks[pos / block_size] * block_size
                                    + pos % block_size) * row + g0 * head_dim;
                for (int64_t b = 0; b < span; b += FLOATS_PER_LINE) {
                    __builtin_prefetch(k + at + b, 0, 3);
                    __builtin_prefetch(v + at + b, 0, 3);
                }
            }
            for (int64_t j = 0; j < heads; ++j) {
                const int64_t off = (j / group) * head_dim; /* this head's KV head in a row */
                float m = top[j];
                for (int64_t i = 0; i < n; ++i) {
                    p[i] = dot(qs[j], krow[i] + off, head_dim);
                    m = p[i] > m ? p[i] : m;
                }
                if (m > top[j]) { /* a new maximum: rescale what the earlier tiles summed */
                    const float alpha = exp_nonpositive(top[j] - m);
                    total[j] *= alpha;
                    for (int64_t d = 0; d < head_dim; ++d) acc[j][d] *= alpha;
                    top[j] = m;
                }
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int64_t i = 0; i < n; ++i) {
                    p[i] = exp_nonpositive(p[i] - m);
                    sum += p[i];
                }
                total[j] += sum;
                add_weighted_rows(acc[j], p, vrow, off, n, head_dim);
            }
        }
        float *o = out + (token_idx[r] * num_heads + g0 * group) * head_dim;
        for (int64_t j = 0; j < heads; ++j)
            for (int64_t d = 0; d < head_dim; ++d) o[j * head_dim + d] = acc[j][d] / total[j];
    }
    return 0;
}
