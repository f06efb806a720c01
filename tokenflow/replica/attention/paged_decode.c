/* Paged decode attention on the CPU, float32: each decoding request's one query attends over
 * its context where it lies in the paged KV cache, through its block table row. No gather copy,
 * no padding, no mask: keys are read in place, once per KV head for all of its query heads.
 *
 * Built by tokenflow/replica/attention/cpu_kernel.py (cc -O3 -march=native -fopenmp); loaded
 * after torch, so OpenMP is torch's own runtime (one thread pool, not two spinning ones).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Query heads per KV head this kernel handles on the stack (more: the torch backend). */
#define MAX_GROUP 16
/* Largest head_dim handled on the stack. */
#define MAX_HEAD_DIM 256

/* e^x for x <= 0 (a score minus its row's maximum), within ~2 ulp: 2^n * e^r with
 * |r| <= ln2 / 2 and a degree-6 polynomial. Inline arithmetic, so the loops over scores
 * vectorize (libm's expf is one call per score). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = __builtin_roundf(x * 1.44269504f);
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
    const int64_t tasks = num_decodes * num_kv_heads;
    const int64_t row = num_kv_heads * head_dim; /* floats between two tokens of a block */
    for (int64_t t = 0; t < num_tokens; ++t)
        for (int64_t g = 0; g < num_kv_heads; ++g) {
            const int64_t at = slots[t] * row + g * head_dim;
            memcpy(k + at, new_k + t * k_tok + g * k_head, sizeof(float) * (size_t)head_dim);
            memcpy(v + at, new_v + t * v_tok + g * v_head, sizeof(float) * (size_t)head_dim);
        }
#pragma omp parallel for schedule(dynamic, 1) if (tasks > 1)
    for (int64_t task = 0; task < tasks; ++task) {
        const int64_t r = task / num_kv_heads, g = task % num_kv_heads;
        const int64_t seq = seq_lens[r];
        const int64_t first = (window > 0 && seq > window) ? seq - window : 0;
        const int64_t n = seq - first;
        const int32_t *blocks = table + r * table_stride;
        const float *qr = q + token_idx[r] * q_tok + g * group * q_head;
        float *scores = malloc(sizeof(float) * (size_t)(group * n));
        float qs[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM], top[MAX_GROUP];
        for (int64_t j = 0; j < group; ++j) {
            for (int64_t d = 0; d < head_dim; ++d) qs[j][d] = qr[j * q_head + d] * scale;
            for (int64_t d = 0; d < head_dim; ++d) acc[j][d] = 0.0f;
            top[j] = -INFINITY;
        }
        /* Scores: each key row is read once for the whole group. */
        for (int64_t i = 0; i < n; ++i) {
            const int64_t pos = first + i;
            const float *kr = k + ((int64_t)blocks[pos / block_size] * block_size
                                   + pos % block_size) * row + g * head_dim;
            for (int64_t j = 0; j < group; ++j) {
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < head_dim; ++d) s += qs[j][d] * kr[d];
                scores[j * n + i] = s;
                if (s > top[j]) top[j] = s;
            }
        }
        float total[MAX_GROUP];
        for (int64_t j = 0; j < group; ++j) {
            float sum = 0.0f;
            float *sj = scores + j * n;
            const float m = top[j];
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < n; ++i) {
                sj[i] = exp_nonpositive(sj[i] - m);
                sum += sj[i];
            }
            total[j] = sum;
        }
        /* Weighted values: each value row read once for the group. */
        for (int64_t i = 0; i < n; ++i) {
            const int64_t pos = first + i;
            const float *vr = v + ((int64_t)blocks[pos / block_size] * block_size
                                   + pos % block_size) * row + g * head_dim;
            for (int64_t j = 0; j < group; ++j) {
                const float p = scores[j * n + i];
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) acc[j][d] += p * vr[d];
            }
        }
        float *o = out + (token_idx[r] * num_heads + g * group) * head_dim;
        for (int64_t j = 0; j < group; ++j)
            for (int64_t d = 0; d < head_dim; ++d) o[j * head_dim + d] = acc[j][d] / total[j];
        free(scores);
    }
    return 0;
}
