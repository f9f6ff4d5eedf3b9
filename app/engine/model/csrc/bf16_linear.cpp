// A linear layer with bfloat16 weights and float32 activations, for the one or two rows of a decode
// step (more rows: ``bf16_packed.cpp``).
//
// With few rows a linear layer is bound by the bytes of its weights: each weight is used once per
// row. Stored in bfloat16, they are half the bytes of float32; widened to float32 in registers
// (a bfloat16 is the top half of a float32), the products and sums stay in float32. This is the
// few-row bfloat16 path of CPUs without native bfloat16 instructions (AVX2), where oneDNN's bfloat16
// kernels do not run, and of CPUs with AVX512-BF16 but no AMX, where it streams the weights faster
// than they do (``cpu_linear.bf16_kernel_rows``).
//
// y[m, n] = sum_k x[m, k] * w[n, k] (``linear_bf16w`` adds the bias). Threads split the output
// features; each task walks a block of weight rows (4 for 1-2 rows of x, else 2) against up to 2 or
// 4 rows of x at a time, so a block of weights is widened once per tile of rows and stays in L1 for
// the next tile.
#include "kernels.h"

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FORESERVE_AVX2 1
#endif

namespace {

// Prefetch this many weight rows ahead, into L2. A task's NR rows are NR short streams (k bfloat16s
// each, 18 cache lines at k = 576): too short for the hardware prefetcher to lock on before each ends.
// Each tile fetches, at the column it reads, the NR rows PREFETCH_ROWS on, which keeps the reads
// ~PREFETCH_ROWS * k * 2 bytes (18 KB at k = 576) behind the fetches. One row's linears of a decode
// step (SmolLM2-135M, 269 MB, 2 threads, AMD EPYC Zen 4; ``python -m loadtests.bench.linear_bandwidth``):
// 4 rows ahead into L1 read 16-20 GB/s; 12-24 rows ahead into L2 read 26-37 GB/s, as fast as a plain
// sum over as many bytes (26-33 GB/s). L2 holds many more misses in flight than L1.
constexpr int64_t PREFETCH_ROWS = 16;

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

#ifdef FORESERVE_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// Outputs [n0, n0 + NR) of rows [m0, m0 + MR): y[m, n] = x[m] . w[n] over k elements. ``xe``/``xo``
// hold each row's even- and odd-indexed elements apart ([m, k / 2] each, ``k2`` = k / 2 rounded down
// to a multiple of 8): 16 bfloat16 weights load as 8 32-bit lanes, and the even ones widen with a
// shift, the odd ones with a mask, 5 instructions where widening 8 at a time took 8.
template <int NR, int MR>
inline void tile(const float* x, const float* xe, const float* xo, int64_t k2, const uint16_t* w, float* y,
                 int64_t k, int64_t ldy, int64_t m0, int64_t n0) {
  float sums[MR][NR];
  int64_t kk = 0;
#ifdef FORESERVE_AVX2
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  const __m256i odd_mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (; 2 * kk + 16 <= 2 * k2; kk += 8) {  // kk counts pairs: weights [2 kk, 2 kk + 16)
    __m256 we[NR], wo[NR];
    if (m0 == 0)  // the rows PREFETCH_ROWS on, at this column (once per weight block)
      for (int j = 0; j < NR; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w + (n0 + PREFETCH_ROWS + j) * k + 2 * kk), _MM_HINT_T1);
    for (int j = 0; j < NR; ++j) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (n0 + j) * k + 2 * kk));
      we[j] = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
      wo[j] = _mm256_castsi256_ps(_mm256_and_si256(raw, odd_mask));
    }
    for (int i = 0; i < MR; ++i) {
      const __m256 xev = _mm256_loadu_ps(xe + (m0 + i) * k2 + kk);
      const __m256 xov = _mm256_loadu_ps(xo + (m0 + i) * k2 + kk);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xov, wo[j], _mm256_fmadd_ps(xev, we[j], acc[i][j]));
    }
  }
  kk *= 2;
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) sums[i][j] = hsum(acc[i][j]);
#else
  (void)xe; (void)xo; (void)k2;
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) sums[i][j] = 0.f;
#endif
  for (; kk < k; ++kk)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) sums[i][j] += x[(m0 + i) * k + kk] * bf16_to_float(w[(n0 + j) * k + kk]);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[(m0 + i) * ldy + n0 + j] = sums[i][j];
}

// Rows [0, m) against outputs [n0, n0 + NR): tiles of MR rows, then one of the rows left.
template <int NR, int MR>
inline void rows(const float* x, const float* xe, const float* xo, int64_t k2, const uint16_t* w, float* y, int64_t m,
                 int64_t k, int64_t n, int64_t n0) {
  int64_t m0 = 0;
  for (; m0 + MR <= m; m0 += MR) tile<NR, MR>(x, xe, xo, k2, w, y, k, n, m0, n0);
  switch (m - m0) {
    case 3: tile<NR, 3>(x, xe, xo, k2, w, y, k, n, m0, n0); break;
    case 2: tile<NR, 2>(x, xe, xo, k2, w, y, k, n, m0, n0); break;
    case 1: tile<NR, 1>(x, xe, xo, k2, w, y, k, n, m0, n0); break;
    default: break;
  }
}

// All of y: threads split the output features in blocks of NR.
template <int NR, int MR>
void run(const float* x, const float* xe, const float* xo, int64_t k2, const uint16_t* w, float* y, int64_t m, int64_t k,
         int64_t n) {
  const int64_t blocks = n / NR;
  // NOTE: 64 KB of weights a task at least: enough work to be worth a thread
  const int64_t grain = std::max<int64_t>(1, 32768 / (NR * std::max<int64_t>(1, k)));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) rows<NR, MR>(x, xe, xo, k2, w, y, m, k, n, b * NR);
  });
  for (int64_t n0 = blocks * NR; n0 < n; ++n0) rows<1, MR>(x, xe, xo, k2, w, y, m, k, n, n0);
}

}  // namespace

// x [m, k] float32; w [n, k] bfloat16 -> [m, n] float32
at::Tensor linear_bf16w_dot(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear_bf16w: x [m, k] and w [n, k]");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "linear_bf16w: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kBFloat16,
              "linear_bf16w: float32 x and bfloat16 w only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "linear_bf16w: contiguous tensors only");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  auto y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const float* x_p = x.data_ptr<float>();
  const uint16_t* w_p = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  float* y_p = y.data_ptr<float>();
  // each row's even- and odd-indexed elements apart, over the first 2 * k2 elements (see ``tile``)
  const int64_t k2 = (k / 2) / 8 * 8;
  std::vector<float> xe(m * k2), xo(m * k2);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t e = 0; e < k2; ++e) {
      xe[i * k2 + e] = x_p[i * k + 2 * e];
      xo[i * k2 + e] = x_p[i * k + 2 * e + 1];
    }
  // NOTE: 16 ymm registers hold MR x NR accumulators, the NR rows' widened weights (2 each) and a
  // row of x: 1-2 rows take 4 weight rows at a time (4 chains of sums, so one row is not bound by
  // the FMAs' latency); more take 2 weight rows against 4 rows of x, so each widened weight feeds
  // 4 rows (8 accumulators + 4 + 2 registers).
  if (m <= 2)
    run<4, 2>(x_p, xe.data(), xo.data(), k2, w_p, y_p, m, k, n);
  else
    run<2, 4>(x_p, xe.data(), xo.data(), k2, w_p, y_p, m, k, n);
  return y;
}
