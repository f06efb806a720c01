/* The multi-LoRA delta of one (fused) projection on the CPU: every token through its own
 * adapter's slot, in one call (tokenflow::lora_delta).
 *
 * For token t in slot s (-1: the base model, skipped) and each part p of the projection
 * (q, k, v of a fused qkv; gate, up; or the one part of o and down) the adapter adds
 *
 *     y[t, part p's columns] += (A_sp x_t) B_sp^T        (A_sp: r x in, B_sp: part x r)
 *
 * with the slot weights laid out as models/lora.py holds them: `a` [S * P * R, in] and `bt`
 * [S * P * R, out] (B^T, scaling folded in), row (s * P + p) * R + j. `ranks` [S, P] is each
 * slot's rank per part (0: the adapter leaves that part alone, so it costs nothing).
 *
 * Why a kernel: through torch, a step's delta is 2-5 ops a projection, ~120 calls a step on a
 * 30-layer model, each ~15-70 us whatever its size; and a fused projection's B^T is
 * block-diagonal (part p's rank rows feed only part p's columns), so a matmul over it does
 * 2-3x the multiply-adds the parts need. The BLAS also runs these skinny shapes (inner
 * dimension 8-24) at a fraction of its speed. Here a token's shrink is P * r dot products
 * over its row of x, and its expand adds r rows of B^T to each part's columns of y, which
 * stays in L1 (a vector of 16 columns accumulates over the r rows in registers).
 *
 * float32 in and out; tokens run in parallel on torch's OpenMP threads. Built by
 * models/lora_kernel.py.
 */
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kMaxRank = 1024;  // a part's rank a token's shrink holds (lora_kernel.py)
constexpr int64_t kLanes = 16;        // output columns a vector of the expand accumulates

// y[0, n) += sum_j shrunk[j] * b[j * ldb + c], j < r: 16 columns at a time held in a vector
// across the r rows (GCC vectorizes the lane loop), then the tail one column at a time.
inline void expand(float *__restrict y, const float *__restrict b, int64_t ldb,
                   const float *__restrict shrunk, int64_t r, int64_t n) {
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) {
    float acc[kLanes];
    for (int64_t l = 0; l < kLanes; ++l) acc[l] = y[c + l];
    for (int64_t j = 0; j < r; ++j) {
      const float w = shrunk[j];
      const float *bj = b + j * ldb + c;
#pragma omp simd
      for (int64_t l = 0; l < kLanes; ++l) acc[l] += w * bj[l];
    }
    for (int64_t l = 0; l < kLanes; ++l) y[c + l] = acc[l];
  }
  for (; c < n; ++c) {
    float acc = y[c];
    for (int64_t j = 0; j < r; ++j) acc += shrunk[j] * b[j * ldb + c];
    y[c] = acc;
  }
}

/* y [T, out] += each token's delta. x [T, in]; a [S * P * R, in]; bt [S * P * R, out];
 * ranks int32 [S, P]; token_slots int32 [T] (-1: none); part_sizes: P output widths. */
void lora_delta(const at::Tensor &x, const at::Tensor &y, const at::Tensor &a,
                const at::Tensor &bt, const at::Tensor &ranks, const at::Tensor &token_slots,
                c10::IntArrayRef part_sizes, int64_t max_rank) {
  const int64_t T = x.size(0), in = x.size(1), out = y.size(1);
  const int64_t S = ranks.size(0), P = ranks.size(1), width = P * max_rank;
  TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat &&
                  a.scalar_type() == at::kFloat && bt.scalar_type() == at::kFloat,
              "lora_delta: x, y, a and bt must be float32");
  TORCH_CHECK(x.is_contiguous() && a.is_contiguous() && bt.is_contiguous() &&
                  y.stride(1) == 1 && y.size(0) == T,
              "lora_delta: x, a and bt contiguous, y [T, out] with contiguous rows");
  TORCH_CHECK(a.size(0) >= S * width && a.size(1) == in && bt.size(0) == a.size(0) &&
                  bt.size(1) == out,
              "lora_delta: a [S * P * R, in] and bt [S * P * R, out]");
  TORCH_CHECK(ranks.scalar_type() == at::kInt && ranks.is_contiguous() &&
                  token_slots.scalar_type() == at::kInt && token_slots.numel() == T,
              "lora_delta: int32 ranks [S, P] and token_slots [T]");
  TORCH_CHECK(static_cast<int64_t>(part_sizes.size()) == P, "lora_delta: P part sizes");
  TORCH_CHECK(max_rank <= kMaxRank, "lora_delta: rank over ", kMaxRank);
  std::vector<int64_t> first(P + 1, 0);
  for (int64_t p = 0; p < P; ++p) first[p + 1] = first[p] + part_sizes[p];
  TORCH_CHECK(first[P] == out, "lora_delta: the part sizes sum to y's width");
  const float *xp = x.data_ptr<float>(), *ap = a.data_ptr<float>(), *bp = bt.data_ptr<float>();
  float *yp = y.data_ptr<float>();
  const int32_t *rp = ranks.data_ptr<int32_t>(), *sp = token_slots.data_ptr<int32_t>();
  const int64_t ystride = y.stride(0);
#pragma omp parallel for schedule(static) if (T > 1)
  for (int64_t t = 0; t < T; ++t) {
    const int32_t s = sp[t];
    if (s < 0 || s >= S) continue;
    const float *xt = xp + t * in;
    float *yt = yp + t * ystride;
    float shrunk[kMaxRank];  // one part's at a time
    for (int64_t p = 0; p < P; ++p) {
      const int64_t r = rp[s * P + p], row0 = s * width + p * max_rank;
      for (int64_t j = 0; j < r; ++j) {
        const float *arow = ap + (row0 + j) * in;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < in; ++i) acc += arow[i] * xt[i];
        shrunk[j] = acc;
      }
      if (r > 0)
        expand(yt + first[p], bp + row0 * out + first[p], out, shrunk, r, part_sizes[p]);
    }
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenflow, m) {
  m.def("lora_delta(Tensor x, Tensor(a!) y, Tensor a, Tensor bt, Tensor ranks, "
        "Tensor token_slots, int[] part_sizes, int max_rank) -> ()");
}

TORCH_LIBRARY_IMPL(tokenflow, CPU, m) { m.impl("lora_delta", &lora_delta); }
