/* Weight-only quantized matrix products on the CPU, for any number of rows (a decode's one, a
 * prompt's hundreds): int4 groups and int8 rows, multiplied in float32 straight from the
 * quantized bytes.
 *
 * At a few rows a step reads every weight once, so the product is bound by how fast the bytes
 * arrive. torch's packed kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`) run
 * at 11-18 GB/s on this project's machine for one row whether the weights are cold or in cache:
 * bound by their arithmetic, not by memory. These kernels hold the weights in tiles of 16
 * output rows, so that one vector holds one value of 16 rows: a column's codes widen to one
 * vector of floats that multiplies the broadcast input value, with no horizontal sum, and a
 * tile's bytes are one sequential stream (codes and scales interleaved) for the prefetcher.
 *
 *   int4: tile t, group g (32 input columns) is 320 bytes: 16 x 16 bytes of codes (byte j of
 *         the p-th 16 holds row j's codes for columns 2p (low nibble) and 2p+1 (high)), then
 *         the 16 rows' scales and zeros as bfloat16. w = (code - 8) * scale + zero: the
 *         values of torch's int4 kernel and of the layer's dense bfloat16 copy.
 *   int8: tile t is K x 16 int8 (column-major within the tile) and a float scale per row.
 *
 * Inputs are bfloat16, products are summed in float32 and the output stays float32 (rounding
 * each projection's output to bfloat16 cost faithfulness for nothing: bench/fidelity.py).
 *
 * Batch invariance: an output row's arithmetic never depends on how many rows the call has.
 * Each row is summed through the same fixed number of accumulator chains in the same order,
 * whatever the row count; the row count only picks how many rows share one pass over a tile
 * (register blocking), and above one pass a tile's weights are decoded once into a buffer,
 * which yields the same bits as decoding them in the loop. So a prompt's rows, a decode's row
 * and the rows of a batch of 64 give each token the same result bit for bit. Built by
 * tokenflow/replica/models/quantized_kernel.py; registered as torch ops (tokenflow::int4_mv,
 * tokenflow::int8_mv), so a compiled graph calls them as it calls aten's; OpenMP is torch's
 * own runtime (loaded first: one thread pool).
 */
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kRows = 16;   // output rows of a tile: one vector
constexpr int64_t kGroup = 32;  // input columns of an int4 group
constexpr int64_t kCodeBytes = kGroup / 2 * kRows;                   // 256
constexpr int64_t kGroupBytes = kCodeBytes + 2 * kRows * sizeof(uint16_t);  // + scales, zeros
// Input rows one pass over a tile holds in registers (32 vector registers with AVX-512, 16
// without). Only the blocking: a row's sums are the same in a pass of any size.
#if defined(__AVX512F__)
constexpr int64_t kMaxRows = 4;
#else
constexpr int64_t kMaxRows = 2;
#endif
// Accumulator chains per input row, fixed for every row count (batch invariance): FMA latency
// is ~4 cycles at 2 a cycle, so a lone row wants several chains in flight.
constexpr int kChains = 4;

typedef float fvec __attribute__((vector_size(kRows * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(kRows * sizeof(int32_t))));
typedef uint32_t uvec __attribute__((vector_size(kRows * sizeof(uint32_t))));
typedef uint8_t u8vec __attribute__((vector_size(kRows)));
typedef int8_t i8vec __attribute__((vector_size(kRows)));
typedef uint16_t hvec __attribute__((vector_size(kRows * sizeof(uint16_t))));

// 16 bytes widened to 16 int32 lanes (GCC scalarizes __builtin_convertvector of bytes, so
// the widening is the instruction itself where there is one).
inline ivec widen_u8(const uint8_t *p) {
#if defined(__AVX512F__)
  return (ivec)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p));
  __m256i halves[2] = {_mm256_cvtepu8_epi32(b), _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))};
  ivec v;
  std::memcpy(&v, halves, sizeof v);
  return v;
#else
  u8vec b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, ivec);
#endif
}

inline ivec widen_i8(const int8_t *p) {
#if defined(__AVX512F__)
  return (ivec)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p));
  __m256i halves[2] = {_mm256_cvtepi8_epi32(b), _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))};
  ivec v;
  std::memcpy(&v, halves, sizeof v);
  return v;
#else
  i8vec b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, ivec);
#endif
}

// 16 bfloat16 as floats (the top half of a float32: widening is a shift).
inline fvec bf16_vec(const uint8_t *p) {
#if defined(__AVX512F__)
  const __m512i w =
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)));
  return (fvec)_mm512_slli_epi32(w, 16);
#else
  hvec h;
  std::memcpy(&h, p, sizeof h);
  return (fvec)(__builtin_convertvector(h, uvec) << 16);
#endif
}

inline float bf16_to_float(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Stores a tile's 16 sums of input row m, dropping the rows past `valid` (the padding).
inline void store_row(float *out, fvec acc, int64_t valid) {
  std::memcpy(out, &acc, sizeof(float) * size_t(valid));
}

#if defined(__AVX512BF16__)
/* A code c becomes the bfloat16 1 + c / 16 (0x3F80 | c << 3: one shift-or-mask of its byte makes
 * a column pair's two codes one 32-bit lane), so one `vdpbf16ps` multiplies a pair of columns
 * by the input's bfloat16 pair for 16 rows, summed in float32. sum((1 + c / 16) x) = xs +
 * sum(c x) / 16, so sum(c x) = 16 (dot - xs). The pair p of a group (16 bytes of codes): */
inline __m512i decode_pair(const uint8_t *codes, int64_t p) {
  const __m512i nibbles = _mm512_set1_epi32(0x00780078), one = _mm512_set1_epi32(0x3F803F80);
  const __m512i v =
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(codes + p * kRows)));
  const __m512i t = _mm512_slli_epi32(v, 3);
  // (t | t << 12) & nibbles | one: (A & B) | C is ternary-logic table 0xEA.
  return _mm512_ternarylogic_epi32(_mm512_or_si512(t, _mm512_slli_epi32(t, 12)), nibbles, one,
                                   0xEA);
}

/* A tile's codes decoded for all its groups: [groups][16 pairs] vectors, for passes over many
 * input rows (the same bits decode_pair gives in the loop). */
inline void decode_tile(const uint8_t *tile, int64_t groups, __m512i *decoded) {
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t p = 0; p < kGroup / 2; ++p)
      decoded[g * (kGroup / 2) + p] = decode_pair(tile + g * kGroupBytes, p);
}

/* One int4 tile times M input rows (AVX512-BF16); `decoded`: the tile's pairs decoded
 * (decode_tile), or null to decode them here. xpairs: the input rows' bfloat16 as 32-bit
 * pairs [M][K / 2]. */
template <int M>
void int4_tile(const uint8_t *tile, const __m512i *decoded, int64_t groups,
               const uint32_t *xpairs, int64_t K, const float *xsum, float *out, int64_t N,
               int64_t valid) {
  constexpr int C = kChains;
  fvec acc[M] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t *codes = tile + g * kGroupBytes;
    __m512 dot[M][C];
    for (int m = 0; m < M; ++m)
      for (int c = 0; c < C; ++c) dot[m][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < kGroup / 2; p += C) {
      for (int c = 0; c < C; ++c) {
        const __m512i w = decoded ? decoded[g * (kGroup / 2) + p + c] : decode_pair(codes, p + c);
        const int64_t pair = g * kGroup / 2 + p + c;
        for (int m = 0; m < M; ++m)
          dot[m][c] = _mm512_dpbf16_ps(dot[m][c], (__m512bh)w,
                                       (__m512bh)_mm512_set1_epi32(int(xpairs[m * K / 2 + pair])));
      }
    }
    const fvec scale = bf16_vec(codes + kCodeBytes);
    const fvec zero = bf16_vec(codes + kCodeBytes + kRows * sizeof(uint16_t));
    for (int m = 0; m < M; ++m) {
      fvec d = (fvec)dot[m][0];
      for (int c = 1; c < C; ++c) d += (fvec)dot[m][c];
      const float xs = xsum[m * groups + g];
      // sum((c - 8) scale + zero) x = scale (sum(c x) - 8 xs) + zero xs, sum(c x) = 16 (d - xs)
      acc[m] += scale * (16.0f * d - 24.0f * xs) + zero * xs;
    }
  }
  for (int m = 0; m < M; ++m) store_row(out + m * N, acc[m], valid);
}
#else
/* One int4 tile times M input rows x [M][K] (float), their group sums xsum [M][groups]. */
template <int M>
void int4_tile(const uint8_t *tile, const void *, int64_t groups, const float *x, int64_t K,
               const float *xsum, float *out, int64_t N, int64_t valid) {
  constexpr int C = kChains / 2;  // a chain each for the low and the high nibbles
  fvec acc[M] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t *codes = tile + g * kGroupBytes;
    fvec lo_sum[M][C] = {}, hi_sum[M][C] = {};
    for (int64_t p = 0; p < kGroup / 2; p += C) {
      for (int c = 0; c < C; ++c) {
        const ivec v = widen_u8(codes + (p + c) * kRows);
        fvec lo = __builtin_convertvector(v & 15, fvec);
        fvec hi = __builtin_convertvector(v >> 4, fvec);
        const int64_t k = g * kGroup + 2 * (p + c);
        for (int m = 0; m < M; ++m) {
          lo_sum[m][c] += lo * x[m * K + k];
          hi_sum[m][c] += hi * x[m * K + k + 1];
        }
      }
    }
    const fvec scale = bf16_vec(codes + kCodeBytes);
    const fvec zero = bf16_vec(codes + kCodeBytes + kRows * sizeof(uint16_t));
    for (int m = 0; m < M; ++m) {
      fvec dot = lo_sum[m][0] + hi_sum[m][0];
      for (int c = 1; c < C; ++c) dot += lo_sum[m][c] + hi_sum[m][c];
      const float xs = xsum[m * groups + g];
      // sum((code - 8) * scale + zero) * x = scale * (sum(code * x) - 8 * xs) + zero * xs
      acc[m] += scale * (dot - 8.0f * xs) + zero * xs;
    }
  }
  for (int m = 0; m < M; ++m) store_row(out + m * N, acc[m], valid);
}

#endif

/* One int8 tile [K][16] times M input rows; scale: the tile's 16 row scales. */
template <int M>
void int8_tile(const int8_t *tile, int64_t K, const float *x, const float *scale,
               float *out, int64_t N, int64_t valid) {
  constexpr int C = kChains;
  fvec acc[M][C] = {};
  int64_t k = 0;
  for (; k + C <= K; k += C) {
    for (int c = 0; c < C; ++c) {
      const fvec w = __builtin_convertvector(widen_i8(tile + (k + c) * kRows), fvec);
      for (int m = 0; m < M; ++m) acc[m][c] += w * x[m * K + k + c];
    }
  }
  for (; k < K; ++k) {
    const fvec w = __builtin_convertvector(widen_i8(tile + k * kRows), fvec);
    for (int m = 0; m < M; ++m) acc[m][0] += w * x[m * K + k];
  }
  fvec s;
  std::memcpy(&s, scale, sizeof s);
  for (int m = 0; m < M; ++m) {
    fvec sum = acc[m][0];
    for (int c = 1; c < C; ++c) sum += acc[m][c];
    store_row(out + m * N, sum * s, valid);
  }
}

// The input rows as float32 (from bfloat16: exact).
std::vector<float> widen(const at::Tensor &x) {
  const int64_t n = x.numel();
  const auto *h = reinterpret_cast<const uint16_t *>(x.data_ptr());
  std::vector<float> f(n);
#pragma omp parallel for schedule(static) if (n >= 65536)
  for (int64_t i = 0; i < n; ++i) f[i] = bf16_to_float(h[i]);
  return f;
}

void check_input(const at::Tensor &x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, ", K, "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous bfloat16 CPU tensor");
}

// Calls tile(m0, rows) for each chunk of at most kMaxRows input rows, the row count a template
// argument.
template <typename Tile>
inline void for_row_chunks(int64_t M, Tile &&tile) {
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    switch (std::min(kMaxRows, M - m0)) {
      case 1: tile.template operator()<1>(m0); break;
#if defined(__AVX512F__)
      case 2: tile.template operator()<2>(m0); break;
      case 3: tile.template operator()<3>(m0); break;
#endif
      default: tile.template operator()<kMaxRows>(m0); break;
    }
  }
}

/* x [M, K] bfloat16 times int4 tiles [tiles, K / 32, 320] uint8 -> [M, N] float32. */
at::Tensor int4_mv(const at::Tensor &x, const at::Tensor &tiles, int64_t N) {
  const int64_t M = x.size(0), K = tiles.size(1) * kGroup, groups = tiles.size(1);
  check_input(x, K);
  TORCH_CHECK(tiles.scalar_type() == at::kByte && tiles.is_contiguous() && tiles.dim() == 3 &&
                  tiles.size(2) == kGroupBytes && tiles.size(0) * kRows >= N,
              "tiles must be contiguous uint8 [ceil(N / 16), K / 32, 320]");
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
#if !defined(__AVX512BF16__)
  const std::vector<float> xf = widen(x);
#endif
  // Each row's group sums, in order (a row's own, whatever M); over the cores for a prompt's
  // many rows.
  std::vector<float> xsum(M * groups);
  const auto *xh = reinterpret_cast<const uint16_t *>(x.data_ptr());
#pragma omp parallel for schedule(static) if (M * K >= 65536)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0;
      for (int64_t i = 0; i < kGroup; ++i) s += bf16_to_float(xh[m * K + g * kGroup + i]);
      xsum[m * groups + g] = s;
    }
  const auto *w = tiles.data_ptr<uint8_t>();
  float *o = out.data_ptr<float>();
  const int64_t num_tiles = (N + kRows - 1) / kRows;
#pragma omp parallel
  {
#if defined(__AVX512BF16__)
    // Above one pass of rows, each tile is decoded once for all of them.
    std::vector<__m512i> decoded(M > kMaxRows ? size_t(groups * kGroup / 2) : 0);
    __m512i *dec = decoded.empty() ? nullptr : decoded.data();
#else
    const void *dec = nullptr;
#endif
#pragma omp for schedule(static)
    for (int64_t t = 0; t < num_tiles; ++t) {
      const int64_t valid = std::min(kRows, N - t * kRows);
      const uint8_t *tile = w + t * groups * kGroupBytes;
#if defined(__AVX512BF16__)
      if (dec != nullptr) decode_tile(tile, groups, dec);
#endif
      for_row_chunks(M, [&]<int R>(int64_t m0) {
#if defined(__AVX512BF16__)
        const uint32_t *xin = reinterpret_cast<const uint32_t *>(x.data_ptr()) + m0 * K / 2;
#else
        const float *xin = xf.data() + m0 * K;
#endif
        int4_tile<R>(tile, dec, groups, xin, K, xsum.data() + m0 * groups,
                     o + m0 * N + t * kRows, N, valid);
      });
    }
  }
  return out;
}

/* x [M, K] bfloat16 times int8 tiles [tiles, K, 16] with float scales [tiles * 16]
 * -> [M, N] float32. */
at::Tensor int8_mv(const at::Tensor &x, const at::Tensor &tiles, const at::Tensor &scales,
                   int64_t N) {
  const int64_t M = x.size(0), K = tiles.size(1);
  check_input(x, K);
  TORCH_CHECK(tiles.scalar_type() == at::kChar && tiles.is_contiguous() && tiles.dim() == 3 &&
                  tiles.size(2) == kRows && tiles.size(0) * kRows >= N,
              "tiles must be contiguous int8 [ceil(N / 16), K, 16]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == tiles.size(0) * kRows,
              "scales must be contiguous float32 [tiles * 16]");
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  const std::vector<float> xf = widen(x);  // (over the cores for many rows)
  const auto *w = tiles.data_ptr<int8_t>();
  const float *s = scales.data_ptr<float>();
  float *o = out.data_ptr<float>();
  const int64_t num_tiles = (N + kRows - 1) / kRows;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < num_tiles; ++t) {
    const int64_t valid = std::min(kRows, N - t * kRows);
    for_row_chunks(M, [&]<int R>(int64_t m0) {
      int8_tile<R>(w + t * K * kRows, K, xf.data() + m0 * K, s + t * kRows,
                   o + m0 * N + t * kRows, N, valid);
    });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenflow, m) {
  m.def("int4_mv(Tensor x, Tensor tiles, int n) -> Tensor");
  m.def("int8_mv(Tensor x, Tensor tiles, Tensor scales, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenflow, CPU, m) {
  m.impl("int4_mv", &int4_mv);
  m.impl("int8_mv", &int8_mv);
}
