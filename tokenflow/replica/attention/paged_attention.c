/* Paged attention on the CPU, float32 queries over a float32 or bfloat16 cache: decodes
 * (paged_decode_*) and prompts or chunks (paged_prefill_*, after the decodes below).
 *
 * Decodes: each decoding request's one query attends over its context where it lies in the paged KV cache,
 * through its block table row. No gather copy, no padding, no mask: keys are read in place,
 * once per KV head for all of its query heads.
 *
 * Decode attention is bound by memory: every step reads each request's whole K/V once (a
 * bfloat16 cache: half the bytes). So a task reads a token's row of all its KV heads together
 * (contiguous inside a block, so the hardware prefetcher streams whole blocks), in tiles of
 * one vector's width of tokens with an online softmax (no per-task buffer sized by the
 * context). A tile's scores come out as one vector: each token's products stay a vector until
 * one transposing reduction sums the whole tile's (a horizontal sum per token cost more than
 * the loads), and a K or V row is loaded once for all the query heads of its KV head. With few
 * decodes (one request chatting) each context is split into chunks, attended in parallel and
 * merged (flash-decoding), so every core reads.
 *
 * Built by tokenflow/replica/attention/cpu_kernel.py (cc -O3 -march=native -fopenmp
 * -ffp-contract=fast); loaded after torch, so OpenMP is torch's own runtime (one thread pool,
 * not two spinning ones).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

/* Query heads per KV head this kernel handles on the stack (more: the torch backend). */
#define MAX_GROUP 16
/* Query heads one task holds on the stack when it takes all of a request's KV heads. */
#define MAX_HEADS 32
/* Largest head_dim handled on the stack. */
#define MAX_HEAD_DIM 256
/* Bytes of a cache line: the prefetch's stride. */
#define LINE_BYTES 64
/* With fewer tasks than this per thread, contexts are split into chunks ... */
#define TASKS_PER_THREAD 4
/* ... of at least this many tokens (a chunk's partial result costs a merge). */
#define MIN_CHUNK 64

/* GCC/Clang vector extensions: the machine's widest float vector under -march=native. */
#ifdef __AVX512F__
#define VW 16
#else
#define VW 8
#endif
/* Tokens per tile of the online softmax: one vector of scores. */
#define TILE VW
typedef float vec __attribute__((vector_size(VW * sizeof(float))));

static inline vec load(const float *p) {
    vec x;
    memcpy(&x, p, sizeof x); /* an unaligned vector load */
    return x;
}

static inline void store(float *p, vec x) { memcpy(p, &x, sizeof x); }

/* The cache holds float32 or bfloat16 (the top half of a float32: widening is a shift). */
typedef uint16_t hvec __attribute__((vector_size(VW * sizeof(uint16_t))));
typedef uint32_t uvec __attribute__((vector_size(VW * sizeof(uint32_t))));

/* VW elements of a cache row from element i on, as floats. */
static inline vec load_kv(const void *row, int64_t i, const int bf16) {
    if (!bf16) return load((const float *)row + i);
    hvec h;
    memcpy(&h, (const uint16_t *)row + i, sizeof h);
    return (vec)(__builtin_convertvector(h, uvec) << 16);
}

static inline float kv_at(const void *row, int64_t i, const int bf16) {
    if (!bf16) return ((const float *)row)[i];
    union { uint32_t u; float f; } x = {.u = (uint32_t)((const uint16_t *)row)[i] << 16};
    return x.f;
}

/* float32 -> bfloat16, rounding to nearest even (as torch's `.to(torch.bfloat16)`). */
static inline uint16_t to_bf16(float f) {
    union { float f; uint32_t u; } x = {.f = f};
    if ((x.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x.u >> 16) | 0x40u); /* NaN */
    return (uint16_t)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
}

/* The lane sums of x[0..VW) as one vector: lane i is the sum of x[i]'s lanes. A tree of
 * two-source shuffles, each level halving the lanes per vector: ~3 instructions a token
 * where one horizontal sum per token takes ~8. */
static inline vec transpose_sum(const vec *x) {
    vec a[VW / 2], b[VW / 4];
#if VW == 16
    vec c[2];
    for (int i = 0; i < 8; ++i)
        a[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17,
                                       18, 19, 20, 21, 22, 23)
               + __builtin_shufflevector(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15,
                                         24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; ++i)
        b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16,
                                       17, 18, 19, 24, 25, 26, 27)
               + __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20,
                                         21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; ++i)
        c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16,
                                       17, 20, 21, 24, 25, 28, 29)
               + __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18,
                                         19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24,
                                   26, 28, 30)
           + __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25,
                                     27, 29, 31);
#else
    for (int i = 0; i < 4; ++i)
        a[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11)
               + __builtin_shufflevector(x[2 * i], x[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; ++i)
        b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13)
               + __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(b[0], b[1], 0, 2, 4, 6, 8, 10, 12, 14)
           + __builtin_shufflevector(b[0], b[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
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

/* exp_nonpositive on a whole vector (the same steps, lane by lane): a tile's weights at once,
 * where the scalar form ran once per score (GCC does not vectorize its loop). */
typedef int32_t ivec __attribute__((vector_size(VW * sizeof(int32_t))));

static inline vec exp_nonpositive_vec(vec x) {
    const vec floor_at = (vec){0} - 87.0f;
    const ivec low = (ivec)(x < floor_at);
    x = (vec)(((ivec)x & ~low) | ((ivec)floor_at & low));
    const vec y = x * 1.44269504f + 0.5f;
    vec n = __builtin_convertvector(__builtin_convertvector(y, ivec), vec); /* toward 0 */
    n -= (vec)((ivec)(y < n) & (ivec)((vec){0} + 1.0f)); /* floor: one less below zero */
    const vec r = x - n * 0.693145752f - n * 1.42860677e-6f;
    vec p = (vec){0} + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return p * (vec)((__builtin_convertvector(n, ivec) + 127) << 23);
}

/* Where a task is in its softmax: per query head the running maximum, the running sum of
 * e^(score - maximum) and the V rows summed with those weights. */
struct online_softmax {
    float top[MAX_HEADS], total[MAX_HEADS];
    float acc[MAX_HEADS][MAX_HEAD_DIM];
};

/* One tile's keys i in [i0, n) (K rows krow[i], V rows vrow[i], from element off on) for the
 * G query heads qs[G][stride] of one KV head (dim elements each), into their running softmax
 * state: top[G], total[G], acc[G][stride]. Lanes outside [i0, n) add nothing. Inlined with G
 * and bf16 constants, so the heads' vectors stay in registers. */
static inline __attribute__((always_inline)) void attend_tile(
    const int G, const float *qs, const void *const *krow, const void *const *vrow, int64_t off,
    int64_t i0, int64_t n, int64_t dim, int64_t stride, float *top, float *total, float *acc,
    const int bf16) {
    vec part[MAX_GROUP][TILE];
    float p[MAX_GROUP][TILE];
    const int64_t whole = dim - dim % VW;
    for (int64_t i = 0; i < TILE; ++i) {
        if (i < i0 || i >= n) {
            for (int j = 0; j < G; ++j) part[j][i] = (vec){0};
            continue;
        }
        vec s[MAX_GROUP] = {{0}};
        for (int64_t d = 0; d < whole; d += VW) {
            const vec kv = load_kv(krow[i], off + d, bf16);
            for (int j = 0; j < G; ++j) s[j] += load(qs + j * stride + d) * kv;
        }
        for (int64_t d = whole; d < dim; ++d)
            for (int j = 0; j < G; ++j) s[j][0] += qs[j * stride + d] * kv_at(krow[i], off + d, bf16);
        for (int j = 0; j < G; ++j) part[j][i] = s[j];
    }
    for (int j = 0; j < G; ++j) {
        const vec scores = transpose_sum(part[j]);
        float m = top[j];
        for (int64_t i = i0; i < n; ++i) m = scores[i] > m ? scores[i] : m;
        if (m > top[j]) { /* a new maximum: rescale what the earlier tiles summed */
            const float alpha = exp_nonpositive(top[j] - m);
            total[j] *= alpha;
            for (int64_t d = 0; d < dim; ++d) acc[j * stride + d] *= alpha;
            top[j] = m;
        }
        vec e = exp_nonpositive_vec(scores - m);
        for (int64_t i = 0; i < TILE; ++i)
            if (i < i0 || i >= n) e[i] = 0.0f;
        memcpy(p[j], &e, sizeof e);
        float sum = 0.0f;
        for (int64_t i = 0; i < TILE; ++i) sum += e[i];
        total[j] += sum;
    }
    for (int64_t d = 0; d < whole; d += VW) {
        vec a[MAX_GROUP];
        for (int j = 0; j < G; ++j) a[j] = load(acc + j * stride + d);
        for (int64_t i = i0; i < n; ++i) {
            const vec vv = load_kv(vrow[i], off + d, bf16);
            for (int j = 0; j < G; ++j) a[j] += p[j][i] * vv;
        }
        for (int j = 0; j < G; ++j) store(acc + j * stride + d, a[j]);
    }
    for (int64_t d = whole; d < dim; ++d)
        for (int j = 0; j < G; ++j) {
            float a = acc[j * stride + d];
            for (int64_t i = i0; i < n; ++i) a += p[j][i] * kv_at(vrow[i], off + d, bf16);
            acc[j * stride + d] = a;
        }
}

/* attend_tile with the group size as a constant for the common sizes (a head's sums are the
 * same whichever way: each head's are its own). */
static inline __attribute__((always_inline)) void attend_tile_group(
    int64_t group, const float *qs, const void *const *krow, const void *const *vrow,
    int64_t off, int64_t i0, int64_t n, int64_t dim, int64_t stride, float *top, float *total,
    float *acc, const int bf16) {
#define TILE_ARGS krow, vrow, off, i0, n, dim, stride, top, total, acc, bf16
    switch (group) {
    case 1: attend_tile(1, qs, TILE_ARGS); break;
    case 2: attend_tile(2, qs, TILE_ARGS); break;
    case 3: attend_tile(3, qs, TILE_ARGS); break;
    case 4: attend_tile(4, qs, TILE_ARGS); break;
    case 8: attend_tile(8, qs, TILE_ARGS); break;
#undef TILE_ARGS
    default:
        for (int64_t j = 0; j < group; ++j)
            attend_tile(1, qs + j * stride, krow, vrow, off, i0, n, dim, stride, top + j,
                        total + j, acc + j * stride, bf16);
    }
}

/* The step's new keys and values into their slots: new_k/new_v [T, KVH, D] with strides
 * (k_tok, k_head, 1) and (v_tok, v_head, 1), slots [T] flat slot ids; a bfloat16 cache gets
 * them rounded to nearest even. */
static inline __attribute__((always_inline)) void write_new_kv(
    const float *new_k, int64_t k_tok, int64_t k_head, const float *new_v, int64_t v_tok,
    int64_t v_head, const int64_t *slots, int64_t num_tokens, void *k, void *v,
    int64_t num_kv_heads, int64_t head_dim, const int bf16) {
    const int64_t row = num_kv_heads * head_dim;
    for (int64_t t = 0; t < num_tokens; ++t)
        for (int64_t g = 0; g < num_kv_heads; ++g) {
            const int64_t at = slots[t] * row + g * head_dim;
            const float *nk = new_k + t * k_tok + g * k_head, *nv = new_v + t * v_tok + g * v_head;
            if (bf16) {
                for (int64_t d = 0; d < head_dim; ++d) {
                    ((uint16_t *)k)[at + d] = to_bf16(nk[d]);
                    ((uint16_t *)v)[at + d] = to_bf16(nv[d]);
                }
            } else {
                memcpy((float *)k + at, nk, sizeof(float) * (size_t)head_dim);
                memcpy((float *)v + at, nv, sizeof(float) * (size_t)head_dim);
            }
        }
}


/* paged_decode_f32 / paged_decode_bf16: the cache's element type a constant. */
static inline __attribute__((always_inline)) int paged_decode(
    const float *new_k, int64_t k_tok, int64_t k_head, const float *new_v, int64_t v_tok,
    int64_t v_head, const int64_t *slots, int64_t num_tokens, const float *q, int64_t q_tok,
    int64_t q_head, void *k, void *v, const int32_t *table, int64_t table_stride,
    const int32_t *seq_lens, const int64_t *token_idx, int64_t num_decodes, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t window, float scale,
    float *out, const int bf16);

/* First the step's new keys and values go to their slots (new_k/new_v [T, KVH, D] with
 * strides (k_tok, k_head, 1) and (v_tok, v_head, 1); slots [T] int64 flat slot ids); then out[t, h, :] for
 * t = token_idx[r] of each decode r: softmax(scale * q . K) V over the request's keys
 * [max(0, seq - window), seq) (window 0: all).
 *   q        [T, H, D] with strides (q_tok, q_head, 1)
 *   k, v     [blocks, block_size, KVH, D] contiguous (one layer's half of the cache), float32
 *            here, bfloat16 in paged_decode_bf16 (the new keys and values rounded to nearest
 *            even as they are written)
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
    return paged_decode(new_k, k_tok, k_head, new_v, v_tok, v_head, slots, num_tokens, q, q_tok,
                        q_head, k, v, table, table_stride, seq_lens, token_idx, num_decodes,
                        num_heads, num_kv_heads, head_dim, block_size, window, scale, out, 0);
}

int paged_decode_bf16(const float *new_k, int64_t k_tok, int64_t k_head, const float *new_v,
                      int64_t v_tok, int64_t v_head, const int64_t *slots, int64_t num_tokens,
                      const float *q, int64_t q_tok, int64_t q_head, uint16_t *k,
                      uint16_t *v, const int32_t *table, int64_t table_stride,
                      const int32_t *seq_lens, const int64_t *token_idx, int64_t num_decodes,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      int64_t block_size, int64_t window, float scale, float *out) {
    return paged_decode(new_k, k_tok, k_head, new_v, v_tok, v_head, slots, num_tokens, q, q_tok,
                        q_head, k, v, table, table_stride, seq_lens, token_idx, num_decodes,
                        num_heads, num_kv_heads, head_dim, block_size, window, scale, out, 1);
}

static inline __attribute__((always_inline)) int paged_decode(
    const float *new_k, int64_t k_tok, int64_t k_head, const float *new_v, int64_t v_tok,
    int64_t v_head, const int64_t *slots, int64_t num_tokens, const float *q, int64_t q_tok,
    int64_t q_head, void *k, void *v, const int32_t *table, int64_t table_stride,
    const int32_t *seq_lens, const int64_t *token_idx, int64_t num_decodes, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t window, float scale,
    float *out, const int bf16) {
    const int64_t elem = bf16 ? 2 : 4; /* bytes of a cache element */
    const int64_t group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || group * num_kv_heads != num_heads)
        return -1;
    const int64_t row = num_kv_heads * head_dim; /* floats between two tokens of a block */
    write_new_kv(new_k, k_tok, k_head, new_v, v_tok, v_head, slots, num_tokens, k, v,
                 num_kv_heads, head_dim, bf16);
    /* A task reads whole rows (all KV heads of a token: one stream per block); parallelism
     * for few requests comes from chunks of their contexts, not from splitting the rows. */
    const int64_t kv_per_task = num_heads <= MAX_HEADS ? num_kv_heads : 1;
    const int64_t heads = kv_per_task * group; /* query heads of a task */
    const int64_t tasks_per_request = num_kv_heads / kv_per_task;
    /* Few tasks (few decodes): split each context into chunks, so every thread reads. */
    int64_t longest = 0;
    for (int64_t r = 0; r < num_decodes; ++r) {
        const int64_t seq = seq_lens[r];
        const int64_t len = (window > 0 && seq > window) ? window : seq;
        longest = len > longest ? len : longest;
    }
    const int64_t want = (int64_t)omp_get_max_threads() * TASKS_PER_THREAD;
    int64_t chunks = 1;
    const int64_t base = num_decodes * tasks_per_request;
    if (base < want && longest >= 2 * MIN_CHUNK) {
        chunks = (want + base - 1) / base;
        const int64_t most = longest / MIN_CHUNK;
        chunks = chunks < most ? chunks : most;
    }
    /* A chunked task's result: per query head its maximum, its sum and its weighted V sum. */
    const int64_t part_floats = heads * (head_dim + 2);
    float *parts = NULL;
    if (chunks > 1) {
        parts = malloc(sizeof(float) * (size_t)(base * chunks * part_floats));
        if (parts == NULL) chunks = 1;
    }
    const int64_t tasks = base * chunks;
#pragma omp parallel for schedule(dynamic, 1) if (tasks > 1)
    for (int64_t task = 0; task < tasks; ++task) {
        const int64_t unit = task / chunks, chunk = task % chunks;
        const int64_t r = unit / tasks_per_request;
        const int64_t g0 = (unit % tasks_per_request) * kv_per_task; /* first KV head */
        const int64_t seq = seq_lens[r];
        const int64_t first = (window > 0 && seq > window) ? seq - window : 0;
        /* This chunk's keys [lo, hi): whole tiles, the last chunk takes what is left. */
        const int64_t per = ((seq - first + chunks - 1) / chunks + TILE - 1) / TILE * TILE;
        const int64_t lo = first + chunk * per < seq ? first + chunk * per : seq;
        const int64_t hi = lo + per < seq ? lo + per : seq;
        const int32_t *blocks = table + r * table_stride;
        const int64_t span = kv_per_task * head_dim; /* elements of a row this task reads */
        const float *qr = q + token_idx[r] * q_tok + g0 * group * q_head;
        float qs[MAX_HEADS][MAX_HEAD_DIM];
        struct online_softmax st;
        const void *krow[TILE], *vrow[TILE];
        for (int64_t j = 0; j < heads; ++j) {
            for (int64_t d = 0; d < head_dim; ++d) qs[j][d] = qr[j * q_head + d] * scale;
            for (int64_t d = 0; d < head_dim; ++d) st.acc[j][d] = 0.0f;
            st.top[j] = -INFINITY;
            st.total[j] = 0.0f;
        }
        for (int64_t t0 = lo; t0 < hi; t0 += TILE) {
            const int64_t n = hi - t0 < TILE ? hi - t0 : TILE;
            for (int64_t i = 0; i < n; ++i) {
                const int64_t pos = t0 + i;
                const int64_t at = ((int64_t)blocks[pos / block_size] * block_size
                                    + pos % block_size) * row + g0 * head_dim;
                krow[i] = (const char *)k + at * elem;
                vrow[i] = (const char *)v + at * elem;
            }
            /* The next tile's rows are fetched while this one computes: a request's blocks lie
             * anywhere in the cache, so the hardware prefetcher loses the stream at each
             * block's end, and the step is bound by reading the cache from memory. Into L2
             * (locality 2): a tile's lines at once overflow L1's miss queue (measured: L1
             * 10-15% slower). */
            const int64_t next_end = hi - (t0 + TILE) < TILE ? hi : t0 + 2 * TILE;
            for (int64_t pos = t0 + TILE; pos < next_end; ++pos) {
                const int64_t at = ((int64_t)blocks[pos / block_size] * block_size
                                    + pos % block_size) * row + g0 * head_dim;
                for (int64_t b = 0; b < span * elem; b += LINE_BYTES) {
                    __builtin_prefetch((const char *)k + at * elem + b, 0, 2);
                    __builtin_prefetch((const char *)v + at * elem + b, 0, 2);
                }
            }
            for (int64_t g = 0; g < kv_per_task; ++g)
                attend_tile_group(group, qs[g * group], krow, vrow, g * head_dim, 0, n,
                                  head_dim, MAX_HEAD_DIM, st.top + g * group,
                                  st.total + g * group, st.acc[g * group], bf16);
        }
        if (chunks == 1) {
            float *o = out + (token_idx[r] * num_heads + g0 * group) * head_dim;
            for (int64_t j = 0; j < heads; ++j)
                for (int64_t d = 0; d < head_dim; ++d)
                    o[j * head_dim + d] = st.acc[j][d] / st.total[j];
        } else {
            float *part = parts + task * part_floats;
            for (int64_t j = 0; j < heads; ++j) {
                float *h = part + j * (head_dim + 2);
                h[0] = st.top[j];
                h[1] = st.total[j];
                memcpy(h + 2, st.acc[j], sizeof(float) * (size_t)head_dim);
            }
        }
    }
    if (chunks > 1) { /* merge each head's chunks, rescaled to their common maximum */
        for (int64_t unit = 0; unit < base; ++unit) {
            const int64_t r = unit / tasks_per_request;
            const int64_t g0 = (unit % tasks_per_request) * kv_per_task;
            float *o = out + (token_idx[r] * num_heads + g0 * group) * head_dim;
            for (int64_t j = 0; j < heads; ++j) {
                float m = -INFINITY;
                for (int64_t c = 0; c < chunks; ++c) {
                    const float top = parts[((unit * chunks + c) * heads + j) * (head_dim + 2)];
                    m = top > m ? top : m;
                }
                float total = 0.0f, *oj = o + j * head_dim;
                for (int64_t d = 0; d < head_dim; ++d) oj[d] = 0.0f;
                for (int64_t c = 0; c < chunks; ++c) {
                    const float *h = parts + ((unit * chunks + c) * heads + j) * (head_dim + 2);
                    if (h[1] == 0.0f) continue; /* an empty chunk */
                    const float w = exp_nonpositive(h[0] - m);
                    total += w * h[1];
                    for (int64_t d = 0; d < head_dim; ++d) oj[d] += w * h[2 + d];
                }
                for (int64_t d = 0; d < head_dim; ++d) oj[d] /= total;
            }
        }
        free(parts);
    }
    return 0;
}

/* ---- Prefill: the prompts and chunks of a step, causal, over the paged cache ----
 *
 * Each prompt or chunk's queries attend over its context as the cache holds it (this step's
 * K/V written first), so a whole prompt, its chunks and a prefix hit compute every query row
 * the same way: a row's result depends on the row alone, never on how the prompt was split.
 *
 * Prefill is bound by arithmetic, not memory: per query row and tile of TILE keys, TILE * D
 * multiply-adds for the scores and as many for the V sum. So each (prompt, KV head) first
 * copies its context out of the paged blocks as float32, K transposed to [tile][d][TILE]
 * (a tile's scores for one row are then D vector multiply-adds with a broadcast query
 * element, no horizontal sums) and V as [key][D rounded up to 16]. A task then takes
 * PREFILL_ROWS query rows (positions x the query heads of one KV head) and walks its key
 * tiles with an online softmax: scores for S_ROWS rows at a time in registers, the V sums
 * for PV_ROWS rows at a time. Tiles past a row's position (or before its window) are
 * masked lane by lane; a tile no row of the task sees is skipped. */

/* Query rows of one task (the scores and V sums of S_ROWS and PV_ROWS rows divide it). */
#define PREFILL_ROWS 48
#define S_ROWS 16
#define PV_ROWS 6

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* Lanes of a where the comparison `take` holds, of b elsewhere (C has no vector `?:`). */
static inline vec vec_select(ivec take, vec a, vec b) {
    return (vec)(((ivec)a & take) | ((ivec)b & ~take));
}

/* Lane maximum (a shuffle tree) and lane sum of a vector. */
static inline float vec_max(vec x) {
#if VW == 16
    vec y = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    x = vec_select(x > y, x, y);
#endif
    vec z = __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3
#if VW == 16
                                    , 12, 13, 14, 15, 8, 9, 10, 11
#endif
    );
    x = vec_select(x > z, x, z);
    float m = x[0];
    for (int i = 1; i < 4; ++i) m = x[i] > m ? x[i] : m;
    return m;
}

static inline float vec_sum(vec x) {
#if VW == 16
    x += __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
#endif
    x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3
#if VW == 16
                                 , 12, 13, 14, 15, 8, 9, 10, 11
#endif
    );
    return (x[0] + x[2]) + (x[1] + x[3]);
}

/* Floats of the float32 copy of one (prompt, KV head) context of `seq` keys. */
static inline int64_t context_floats(int64_t seq, int64_t head_dim) {
    return round_up(seq, TILE) * (head_dim + round_up(head_dim, 16));
}

/* Scores of S_ROWS rows of qs (pre-scaled, transposed: [dim][PREFILL_ROWS], so a row's
 * element is a constant offset from one pointer) against one tile kt [dim][TILE]. */
static inline __attribute__((always_inline)) void tile_scores(
    const float *qs, int64_t dim, const float *kt, float *scores) {
    vec a[S_ROWS];
    for (int r = 0; r < S_ROWS; ++r) a[r] = (vec){0};
    for (int64_t d = 0; d < dim; ++d) {
        const vec kd = load(kt + d * TILE);
        for (int r = 0; r < S_ROWS; ++r) a[r] += qs[d * PREFILL_ROWS + r] * kd;
    }
    for (int r = 0; r < S_ROWS; ++r) store(scores + r * TILE, a[r]);
}

/* acc[r] += sum_i p[r][i] * vt[i] for PV_ROWS rows over n keys, NV vectors of each V row
 * (from element d0 on; row stride dp). */
static inline __attribute__((always_inline)) void tile_values(
    const int NV, const float *p, const float *vt, int64_t n, int64_t dp, int64_t d0,
    float *acc) {
    vec a[PV_ROWS][4];
    for (int r = 0; r < PV_ROWS; ++r)
        for (int c = 0; c < NV; ++c) a[r][c] = load(acc + r * dp + d0 + c * VW);
    for (int64_t i = 0; i < n; ++i) {
        vec vv[4];
        for (int c = 0; c < NV; ++c) vv[c] = load(vt + i * dp + d0 + c * VW);
        for (int r = 0; r < PV_ROWS; ++r) {
            const float w = p[r * TILE + i];
            for (int c = 0; c < NV; ++c) a[r][c] += w * vv[c];
        }
    }
    for (int r = 0; r < PV_ROWS; ++r)
        for (int c = 0; c < NV; ++c) store(acc + r * dp + d0 + c * VW, a[r][c]);
}

/* Copy key tile `tile` of one (prompt, KV head g) out of the paged cache as float32: K
 * transposed into kt [dim][TILE], V rows into vt [TILE][dp] (zeros past seq and dim). */
static inline __attribute__((always_inline)) void copy_context_tile(
    const void *k, const void *v, const int32_t *blocks, int64_t block_size, int64_t row,
    int64_t g, int64_t dim, int64_t dp, int64_t seq, int64_t tile, float *kt, float *vt,
    const int bf16) {
    const int64_t elem = bf16 ? 2 : 4;
    for (int64_t i = 0; i < TILE; ++i) {
        const int64_t pos = tile * TILE + i;
        float *vrow = vt + i * dp;
        if (pos >= seq) {
            for (int64_t d = 0; d < dim; ++d) kt[d * TILE + i] = 0.0f;
            for (int64_t d = 0; d < dp; ++d) vrow[d] = 0.0f;
            continue;
        }
        const int64_t at = ((int64_t)blocks[pos / block_size] * block_size + pos % block_size)
                           * row + g * dim;
        const char *krow = (const char *)k + at * elem, *vsrc = (const char *)v + at * elem;
        for (int64_t d = 0; d < dim; ++d) {
            kt[d * TILE + i] = kv_at(krow, d, bf16);
            vrow[d] = kv_at(vsrc, d, bf16);
        }
        for (int64_t d = dim; d < dp; ++d) vrow[d] = 0.0f;
    }
}

static inline __attribute__((always_inline)) int paged_prefill(
    const float *q, int64_t q_tok, int64_t q_head, const void *k, const void *v,
    const int32_t *table, int64_t table_stride, const int32_t *query_start_loc,
    const int32_t *seq_lens, const int64_t *reqs, int64_t num_reqs, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t window, float scale,
    float *workspace, int64_t workspace_floats, float *out, const int bf16);

/* out[t, h, :] for every token t of the requests reqs[0..num_reqs) (each a prompt or chunk:
 * its query_len tokens are the last of its seq_len), causal over its context in the cache
 * (k, v as in paged_decode: [blocks, block_size, KVH, D], this step's K/V already written),
 * keys limited to `window` (0: all). workspace: at least the sum over the requests of
 * num_kv_heads * context_floats(seq_len, head_dim) floats (paged_prefill_floats). Returns 0,
 * or -1 when the shapes are beyond the kernel (nothing written). */
int64_t paged_prefill_floats(const int32_t *seq_lens, const int64_t *reqs, int64_t num_reqs,
                             int64_t num_kv_heads, int64_t head_dim) {
    int64_t total = 0;
    for (int64_t s = 0; s < num_reqs; ++s)
        total += num_kv_heads * context_floats(seq_lens[reqs[s]], head_dim);
    return total;
}

int paged_prefill_f32(const float *q, int64_t q_tok, int64_t q_head, const float *k,
                      const float *v, const int32_t *table, int64_t table_stride,
                      const int32_t *query_start_loc, const int32_t *seq_lens,
                      const int64_t *reqs, int64_t num_reqs, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                      int64_t window, float scale, float *workspace, int64_t workspace_floats,
                      float *out) {
    return paged_prefill(q, q_tok, q_head, k, v, table, table_stride, query_start_loc, seq_lens,
                         reqs, num_reqs, num_heads, num_kv_heads, head_dim, block_size, window,
                         scale, workspace, workspace_floats, out, 0);
}

int paged_prefill_bf16(const float *q, int64_t q_tok, int64_t q_head, const uint16_t *k,
                       const uint16_t *v, const int32_t *table, int64_t table_stride,
                       const int32_t *query_start_loc, const int32_t *seq_lens,
                       const int64_t *reqs, int64_t num_reqs, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                       int64_t window, float scale, float *workspace, int64_t workspace_floats,
                       float *out) {
    return paged_prefill(q, q_tok, q_head, k, v, table, table_stride, query_start_loc, seq_lens,
                         reqs, num_reqs, num_heads, num_kv_heads, head_dim, block_size, window,
                         scale, workspace, workspace_floats, out, 1);
}

/* Most prompts or chunks one prefill call takes (their offsets live on the stack). */
#define MAX_PREFILLS 256

static inline __attribute__((always_inline)) int paged_prefill(
    const float *q, int64_t q_tok, int64_t q_head, const void *k, const void *v,
    const int32_t *table, int64_t table_stride, const int32_t *query_start_loc,
    const int32_t *seq_lens, const int64_t *reqs, int64_t num_reqs, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t window, float scale,
    float *workspace, int64_t workspace_floats, float *out, const int bf16) {
    const int64_t group = num_heads / num_kv_heads;
    if (head_dim > MAX_HEAD_DIM || group > PREFILL_ROWS || group * num_kv_heads != num_heads
        || num_reqs > MAX_PREFILLS
        || paged_prefill_floats(seq_lens, reqs, num_reqs, num_kv_heads, head_dim)
               > workspace_floats)
        return -1;
    const int64_t dim = head_dim, dp = round_up(head_dim, 16), row = num_kv_heads * head_dim;
    const int64_t positions = PREFILL_ROWS / group; /* query positions of a task */
    /* Per request: where its contexts' copies start, its first key tile and its tasks. */
    int64_t base[MAX_PREFILLS + 1], first_tile[MAX_PREFILLS], tasks_before[MAX_PREFILLS + 1];
    int64_t tiles_before[MAX_PREFILLS + 1];
    base[0] = tasks_before[0] = tiles_before[0] = 0;
    for (int64_t s = 0; s < num_reqs; ++s) {
        const int64_t r = reqs[s], seq = seq_lens[r];
        const int64_t qlen = query_start_loc[r + 1] - query_start_loc[r];
        const int64_t lo = window > 0 ? seq - qlen - window + 1 : 0; /* first key seen */
        first_tile[s] = (lo > 0 ? lo : 0) / TILE;
        base[s + 1] = base[s] + num_kv_heads * context_floats(seq, dim);
        tasks_before[s + 1] = tasks_before[s] + num_kv_heads * ((qlen + positions - 1) / positions);
        tiles_before[s + 1] = tiles_before[s]
                              + num_kv_heads * (round_up(seq, TILE) / TILE - first_tile[s]);
    }
    const int64_t tiles = tiles_before[num_reqs], tasks = tasks_before[num_reqs];
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t) {
            int64_t s = 0;
            while (tiles_before[s + 1] <= t) ++s;
            const int64_t r = reqs[s], seq = seq_lens[r];
            const int64_t per_head = round_up(seq, TILE) / TILE - first_tile[s];
            const int64_t g = (t - tiles_before[s]) / per_head;
            const int64_t tile = first_tile[s] + (t - tiles_before[s]) % per_head;
            float *kt = workspace + base[s] + g * context_floats(seq, dim);
            float *vt = kt + round_up(seq, TILE) * dim;
            copy_context_tile(k, v, table + r * table_stride, block_size, row, g, dim, dp, seq,
                              tile, kt + tile * dim * TILE, vt + tile * TILE * dp, bf16);
        }
        /* The tasks with most keys (the prompts' last positions) first. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = tasks - 1; task >= 0; --task) {
            int64_t s = 0;
            while (tasks_before[s + 1] <= task) ++s;
            const int64_t r = reqs[s], seq = seq_lens[r];
            const int64_t t0 = query_start_loc[r], qlen = query_start_loc[r + 1] - t0;
            const int64_t blocks_per_head = (qlen + positions - 1) / positions;
            const int64_t g = (task - tasks_before[s]) / blocks_per_head;
            const int64_t i0 = ((task - tasks_before[s]) % blocks_per_head) * positions;
            const int64_t nq = qlen - i0 < positions ? qlen - i0 : positions;
            const int64_t rows = nq * group, pos0 = seq - qlen + i0, last = pos0 + nq - 1;
            const float *kt_all = workspace + base[s] + g * context_floats(seq, dim);
            const float *vt_all = kt_all + round_up(seq, TILE) * dim;
            float qs[PREFILL_ROWS * dim], acc[PREFILL_ROWS * dp];
            float scores[PREFILL_ROWS * TILE], top[PREFILL_ROWS], total[PREFILL_ROWS];
            for (int64_t x = 0; x < PREFILL_ROWS; ++x) { /* rows past `rows`: zeros, unused */
                const float *qr = q + (t0 + i0 + x / group) * q_tok + (g * group + x % group) * q_head;
                for (int64_t d = 0; d < dim; ++d)
                    qs[d * PREFILL_ROWS + x] = x < rows ? qr[d] * scale : 0;
                for (int64_t d = 0; d < dp; ++d) acc[x * dp + d] = 0.0f;
                top[x] = -INFINITY;
                total[x] = 0.0f;
            }
            const int64_t lo = window > 0 ? pos0 - window + 1 : 0;
            const int64_t rows_s = round_up(rows, S_ROWS), rows_pv = round_up(rows, PV_ROWS);
            ivec lane;
            for (int i = 0; i < VW; ++i) lane[i] = i;
            for (int64_t k0 = (lo > 0 ? lo : 0) / TILE * TILE; k0 <= last; k0 += TILE) {
                const float *kt = kt_all + k0 * dim, *vt = vt_all + k0 * dp;
                for (int64_t x = 0; x < rows_s; x += S_ROWS)
                    tile_scores(qs + x, dim, kt, scores + x * TILE);
                /* Whole tile visible to every row: no key after the first row, none before
                 * the last row's window. */
                const int whole = k0 + TILE - 1 <= pos0 && (window <= 0 || k0 > last - window);
                for (int64_t x = 0; x < rows; ++x) {
                    vec sc = load(scores + x * TILE);
                    ivec hidden = (ivec){0};
                    if (!whole) {
                        const int64_t p = pos0 + x / group;
                        const ivec key = lane + (int32_t)k0;
                        hidden = (ivec)(key > (int32_t)p);
                        if (window > 0) hidden |= (ivec)(key <= (int32_t)(p - window));
                        sc = vec_select(hidden, (vec){0} - INFINITY, sc);
                    }
                    const float m = vec_max(sc);
                    if (m == -INFINITY) { /* no key of this tile is visible to the row */
                        store(scores + x * TILE, (vec){0});
                        continue;
                    }
                    if (m > top[x]) { /* a new maximum: rescale what the earlier tiles summed */
                        const float alpha = exp_nonpositive(top[x] - m);
                        total[x] *= alpha;
                        for (int64_t d = 0; d < dp; d += VW)
                            store(acc + x * dp + d, load(acc + x * dp + d) * alpha);
                        top[x] = m;
                    }
                    vec e = exp_nonpositive_vec(sc - top[x]);
                    e = (vec)((ivec)e & ~hidden);
                    total[x] += vec_sum(e);
                    store(scores + x * TILE, e);
                }
                for (int64_t x = rows; x < rows_pv; ++x) store(scores + x * TILE, (vec){0});
                const int64_t n = last + 1 - k0 < TILE ? last + 1 - k0 : TILE;
                for (int64_t x = 0; x < rows_pv; x += PV_ROWS)
                    for (int64_t d0 = 0; d0 < dp; d0 += 4 * VW) {
                        const int64_t left = (dp - d0) / VW;
                        float *a = acc + x * dp;
                        const float *p = scores + x * TILE;
                        switch (left >= 4 ? 4 : left) {
                        case 4: tile_values(4, p, vt, n, dp, d0, a); break;
                        case 3: tile_values(3, p, vt, n, dp, d0, a); break;
                        case 2: tile_values(2, p, vt, n, dp, d0, a); break;
                        default: tile_values(1, p, vt, n, dp, d0, a); break;
                        }
                    }
            }
            for (int64_t x = 0; x < rows; ++x) {
                const int64_t i = x / group, j = x % group;
                float *o = out + ((t0 + i0 + i) * num_heads + g * group + j) * dim;
                for (int64_t d = 0; d < dim; ++d) o[d] = acc[x * dp + d] / total[x];
            }
        }
    }
    return 0;
}

/* ---- Batch invariant: every query row, a decode's or a prompt's, in one arithmetic ----
 *
 * paged_invariant_* attends all of a step's requests, decodes and prompts alike, so that a
 * query row's result depends on nothing but the row: not on the step's other requests, not
 * on whether its prompt came whole, in chunks or after a prefix hit, not on whether it is a
 * decode. Each (position, query head) row walks its keys in tiles of TILE aligned to position
 * 0, reading K and V in place (as the decode kernel does: a score is a vector dot over the
 * head's dimensions, a tile's scores one transposing reduction, an online softmax per tile),
 * with keys outside the row's view (after its position, before its window) masked lane by
 * lane. A task is one KV head of up to INV_POSITIONS positions of one request, so a tile's K/V
 * rows are read once for all of them; which rows share a task never changes a row's sums.
 * No context is split into chunks (the decode kernel's merge would change the sums), so one
 * decode's parallelism is its KV heads. */

/* Query positions of one task. */
#define INV_POSITIONS 16

static inline __attribute__((always_inline)) int paged_invariant(
    const float *new_k, int64_t k_tok, int64_t k_head, const float *new_v, int64_t v_tok,
    int64_t v_head, const int64_t *slots, int64_t num_tokens, const float *q, int64_t q_tok,
    int64_t q_head, void *k, void *v, const int32_t *table, int64_t table_stride,
    const int32_t *query_start_loc, const int32_t *seq_lens, int64_t num_reqs,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    int64_t window, float scale, float *out, const int bf16);

/* First the step's new keys and values go to their slots (as in paged_decode); then out[t,
 * h, :] for every token t of every request r < num_reqs (its query_len tokens the last of its
 * seq_len): softmax(scale * q . K) V over the keys its position sees (window 0: all before
 * it). Arguments as paged_decode's and paged_prefill's. Returns 0, or -1 when the shapes are
 * beyond the stack buffers (nothing written, not even k/v) or memory ran out (k/v written). */
int paged_invariant_f32(const float *new_k, int64_t k_tok, int64_t k_head, const float *new_v,
                        int64_t v_tok, int64_t v_head, const int64_t *slots, int64_t num_tokens,
                        const float *q, int64_t q_tok, int64_t q_head, float *k, float *v,
                        const int32_t *table, int64_t table_stride,
                        const int32_t *query_start_loc, const int32_t *seq_lens,
                        int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int64_t block_size, int64_t window, float scale,
                        float *out) {
    return paged_invariant(new_k, k_tok, k_head, new_v, v_tok, v_head, slots, num_tokens, q,
                           q_tok, q_head, k, v, table, table_stride, query_start_loc, seq_lens,
                           num_reqs, num_heads, num_kv_heads, head_dim, block_size, window,
                           scale, out, 0);
}

int paged_invariant_bf16(const float *new_k, int64_t k_tok, int64_t k_head, const float *new_v,
                         int64_t v_tok, int64_t v_head, const int64_t *slots,
                         int64_t num_tokens, const float *q, int64_t q_tok, int64_t q_head,
                         uint16_t *k, uint16_t *v, const int32_t *table, int64_t table_stride,
                         const int32_t *query_start_loc, const int32_t *seq_lens,
                         int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t block_size, int64_t window, float scale,
                         float *out) {
    return paged_invariant(new_k, k_tok, k_head, new_v, v_tok, v_head, slots, num_tokens, q,
                           q_tok, q_head, k, v, table, table_stride, query_start_loc, seq_lens,
                           num_reqs, num_heads, num_kv_heads, head_dim, block_size, window,
                           scale, out, 1);
}

static inline __attribute__((always_inline)) int paged_invariant(
    const float *new_k, int64_t k_tok, int64_t k_head, const float *new_v, int64_t v_tok,
    int64_t v_head, const int64_t *slots, int64_t num_tokens, const float *q, int64_t q_tok,
    int64_t q_head, void *k, void *v, const int32_t *table, int64_t table_stride,
    const int32_t *query_start_loc, const int32_t *seq_lens, int64_t num_reqs,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    int64_t window, float scale, float *out, const int bf16) {
    const int64_t elem = bf16 ? 2 : 4;
    const int64_t group = num_heads / num_kv_heads, dim = head_dim;
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || group * num_kv_heads != num_heads)
        return -1;
    int64_t *tasks_before = malloc(sizeof(int64_t) * (size_t)(num_reqs + 1));
    if (tasks_before == NULL) return -1;
    tasks_before[0] = 0;
    for (int64_t r = 0; r < num_reqs; ++r) {
        const int64_t qlen = query_start_loc[r + 1] - query_start_loc[r];
        tasks_before[r + 1] = tasks_before[r]
                              + num_kv_heads * ((qlen + INV_POSITIONS - 1) / INV_POSITIONS);
    }
    const int64_t row = num_kv_heads * head_dim; /* elements between two tokens of a block */
    write_new_kv(new_k, k_tok, k_head, new_v, v_tok, v_head, slots, num_tokens, k, v,
                 num_kv_heads, head_dim, bf16);
    const int64_t tasks = tasks_before[num_reqs];
    const int64_t state_floats = INV_POSITIONS * group * (2 * dim + 2);
    int failed = 0;
#pragma omp parallel if (tasks > 1)
    {
        /* Per position: its query heads' scaled queries, sums, maxima and totals. */
        float *state = malloc(sizeof(float) * (size_t)state_floats);
        if (state == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        /* The tasks with most keys (the prompts' last positions) first. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = tasks - 1; task >= 0; --task) {
            if (state == NULL) continue;
            int64_t lo_r = 0, hi_r = num_reqs - 1; /* the request: binary search */
            while (lo_r < hi_r) {
                const int64_t mid = (lo_r + hi_r + 1) / 2;
                if (tasks_before[mid] <= task) lo_r = mid; else hi_r = mid - 1;
            }
            const int64_t r = lo_r, seq = seq_lens[r];
            const int64_t t0 = query_start_loc[r], qlen = query_start_loc[r + 1] - t0;
            const int64_t blocks_per_head = (qlen + INV_POSITIONS - 1) / INV_POSITIONS;
            const int64_t g = (task - tasks_before[r]) / blocks_per_head;
            const int64_t x0 = ((task - tasks_before[r]) % blocks_per_head) * INV_POSITIONS;
            const int64_t nx = qlen - x0 < INV_POSITIONS ? qlen - x0 : INV_POSITIONS;
            const int64_t pos0 = seq - qlen + x0, last = pos0 + nx - 1;
            float *qs = state, *acc = state + INV_POSITIONS * group * dim;
            float *top = acc + INV_POSITIONS * group * dim, *total = top + INV_POSITIONS * group;
            for (int64_t x = 0; x < nx; ++x)
                for (int64_t j = 0; j < group; ++j) {
                    const float *qr = q + (t0 + x0 + x) * q_tok + (g * group + j) * q_head;
                    float *qd = qs + (x * group + j) * dim, *ad = acc + (x * group + j) * dim;
                    for (int64_t d = 0; d < dim; ++d) qd[d] = qr[d] * scale;
                    for (int64_t d = 0; d < dim; ++d) ad[d] = 0.0f;
                    top[x * group + j] = -INFINITY;
                    total[x * group + j] = 0.0f;
                }
            const int32_t *blocks = table + r * table_stride;
            const int64_t first = window > 0 && pos0 - window + 1 > 0 ? pos0 - window + 1 : 0;
            const void *krow[TILE], *vrow[TILE];
            for (int64_t k0 = first / TILE * TILE; k0 <= last; k0 += TILE) {
                const int64_t n_tile = last + 1 - k0 < TILE ? last + 1 - k0 : TILE;
                for (int64_t i = 0; i < n_tile; ++i) {
                    const int64_t pos = k0 + i;
                    const int64_t at = ((int64_t)blocks[pos / block_size] * block_size
                                        + pos % block_size) * row + g * head_dim;
                    krow[i] = (const char *)k + at * elem;
                    vrow[i] = (const char *)v + at * elem;
                }
                /* The next tile's rows while this one computes (a request's blocks lie
                 * anywhere in the cache: the prefetcher loses the stream at each block). */
                const int64_t next_end = last + 1 < k0 + 2 * TILE ? last + 1 : k0 + 2 * TILE;
                for (int64_t pos = k0 + TILE; pos < next_end; ++pos) {
                    const int64_t at = ((int64_t)blocks[pos / block_size] * block_size
                                        + pos % block_size) * row + g * head_dim;
                    for (int64_t b = 0; b < head_dim * elem; b += LINE_BYTES) {
                        __builtin_prefetch((const char *)k + at * elem + b, 0, 2);
                        __builtin_prefetch((const char *)v + at * elem + b, 0, 2);
                    }
                }
                for (int64_t x = 0; x < nx; ++x) {
                    const int64_t pos = pos0 + x;
                    const int64_t n = pos + 1 - k0 < TILE ? pos + 1 - k0 : TILE;
                    const int64_t lo = window > 0 ? pos - window + 1 - k0 : 0;
                    const int64_t i0 = lo > 0 ? lo : 0;
                    if (n <= 0 || i0 >= n) continue; /* no key of this tile in its view */
                    attend_tile_group(group, qs + x * group * dim, krow, vrow, 0, i0, n, dim,
                                      dim, top + x * group, total + x * group,
                                      acc + x * group * dim, bf16);
                }
            }
            for (int64_t x = 0; x < nx; ++x)
                for (int64_t j = 0; j < group; ++j) {
                    float *o = out + ((t0 + x0 + x) * num_heads + g * group + j) * dim;
                    const float *a = acc + (x * group + j) * dim;
                    const float t = total[x * group + j];
                    for (int64_t d = 0; d < dim; ++d) o[d] = a[d] / t;
                }
        }
        free(state);
    }
    free(tasks_before);
    return failed ? -1 : 0;
}
