// A linear layer with bfloat16 weights and float32 activations for batches of rows (a decode step
// of many sequences, a short prefill chunk): up to 96 rows, except on CPUs with AMX
// (``cpu_linear.bf16_kernel_rows``).
//
// ``bf16_linear.cpp`` takes one dot product per output: right for one row, where the weights'
// bytes bound the step. With more rows the products bind it, and dot products pay for a
// horizontal sum per output and for two dependent FMAs per accumulator. Here the weights are packed
// once (``pack_bf16w``) into panels of 16 output features: for each pair of input elements (2 kp,
// 2 kp + 1) the panel holds the 16 features' two bfloat16 weights side by side. Each row's pair of
// inputs is broadcast and the products go straight into per-feature accumulators, no horizontal
// sums (the GEMM micro-kernel shape of BLIS and oneDNN). Two micro-kernels read the same panels:
// - AVX512-BF16 (``FORESERVE_AVX512BF16``): the rows are rounded to bfloat16 once per call, as
//   oneDNN's and llama.cpp's bfloat16 kernels round them; one 64-byte load is a pair of 16
//   features' weights and one vdpbf16ps per row multiplies both elements and adds the two products
//   into 16 float32 sums. 8 rows x 2 panels, 16 zmm accumulators. On an AMD EPYC (Zen 4, 2 threads)
//   it runs at 290-410 GFLOP/s at 4-64 rows, 1.6-2.1x the AVX2 micro-kernel on the same CPU.
// - AVX2: the rows stay float32; one 32-byte load gives 8 features' pair, widened to float32 with a
//   shift (the even element) and a mask (the odd). 6 rows x 16 features, 12 ymm accumulators. On an
//   AMD EPYC (Zen 3, 2 threads) it runs at 100-130 GFLOP/s at 4-96 rows, 1.5-2.4x the dot products.
// (``python -m loadtests.bench.linear_microbench``.)
//
// Packed layout, bfloat16: [ceil(n / 16)][k / 2][16][2] (k even), features past n zeros.
// y[m, n] = sum_k x[m, k] * w[n, k], sums in float32 in k's order, x rounded to bfloat16 first on
// the AVX512-BF16 path (``linear_bf16w`` adds the bias).
#include "kernels.h"


#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FORESERVE_AVX2 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#define FORESERVE_AVX512BF16 1
#endif

namespace {

constexpr int64_t PANEL = 16;  // output features per panel
constexpr int64_t MR = 6;      // rows per micro-tile
constexpr int64_t DOT_ROWS = 1;  // up to this many rows, linear_bf16w takes the dot products
// A panel is one contiguous stream; each pair's cache line fetches, into L2, the line this many bytes
// on (the next panel's, near a panel's end). Decode steps of 8 rows, SmolLM2-135M, 2 threads, AMD EPYC
// (Zen 4), 512 cached tokens: 178-191 tok/s without (3 runs), 256-289 with (4 runs; ``python -m
// loadtests.bench.runner_microbench``).
constexpr int64_t PREFETCH_BYTES = 16384;

#define UNROLL _Pragma("GCC unroll 8")

inline float widen(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Rows [0, R) of x against one panel (``p``: its k2 pairs of 16 features), into y's columns [n0, n0 + cols).
template <int R>
inline void micro(const float* x, int64_t k, const uint16_t* p, int64_t k2, float* y, int64_t ldy, int64_t n0,
                  int64_t cols) {
  alignas(32) float out[R][PANEL];
#ifdef FORESERVE_AVX2
  // NOTE: 16 ymm registers: R x 2 accumulators (12 at R = 6), the two widened weight vectors, a
  // broadcast x and the odd elements' mask. A pair's weights are loaded twice (L1 hits), widened
  // once for the even element and once for the odd, so the raw pair holds no register while the
  // rows' FMAs run. The row loops are unrolled before GCC's scalar replacement, else it keeps the
  // accumulators on the stack (a store per FMA, about half the speed); so is a tail after the loop
  // (an odd k), which is why k is even here.
  __m256 acc[R][2];
  UNROLL for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  const __m256i odd_mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m256i* w = reinterpret_cast<const __m256i*>(p);  // 2 vectors (16 features) per pair
  for (int64_t kp = 0; kp < k2; ++kp, w += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(w) + PREFETCH_BYTES, _MM_HINT_T1);
    const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(w), 16));
    const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(w + 1), 16));
    UNROLL for (int i = 0; i < R; ++i) {
      const __m256 xe = _mm256_broadcast_ss(x + i * k + 2 * kp);
      acc[i][0] = _mm256_fmadd_ps(xe, e0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xe, e1, acc[i][1]);
    }
    const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(w), odd_mask));
    const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(w + 1), odd_mask));
    UNROLL for (int i = 0; i < R; ++i) {
      const __m256 xo = _mm256_broadcast_ss(x + i * k + 2 * kp + 1);
      acc[i][0] = _mm256_fmadd_ps(xo, o0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xo, o1, acc[i][1]);
    }
  }
  if (cols == PANEL) {
    UNROLL for (int i = 0; i < R; ++i) {
      _mm256_storeu_ps(y + i * ldy + n0, acc[i][0]);
      _mm256_storeu_ps(y + i * ldy + n0 + 8, acc[i][1]);
    }
    return;
  }
  UNROLL for (int i = 0; i < R; ++i) {
    _mm256_store_ps(out[i], acc[i][0]);
    _mm256_store_ps(out[i] + 8, acc[i][1]);
  }
#else
  for (int i = 0; i < R; ++i)
    for (int64_t j = 0; j < PANEL; ++j) {
      float sum = 0.f;
      for (int64_t kk = 0; kk < 2 * k2; ++kk) sum += x[i * k + kk] * widen(p[((kk / 2) * PANEL + j) * 2 + kk % 2]);
      out[i][j] = sum;
    }
#endif
  for (int i = 0; i < R; ++i) std::memcpy(y + i * ldy + n0, out[i], cols * sizeof(float));
}


#ifdef FORESERVE_AVX512BF16
constexpr int64_t MR_DP = 8;  // rows per micro-tile of the bfloat16 dot products
constexpr int NP_DP = 2;      // panels per micro-tile

// x [count] float32 -> bfloat16, rounded to nearest even (pairs of elements read as 32-bit words)
void round_rows(const float* x, int64_t count, uint16_t* out) {
  int64_t i = 0;
  for (; i + 16 <= count; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
  if (i < count) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (count - i)) - 1);
    _mm256_mask_storeu_epi16(out + i, tail, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(tail, x + i)));
  }
}

// Rows [0, R) of xb (bfloat16 pairs, [R][k2] 32-bit words) against NP panels from ``p``, into y's
// columns [n0, n0 + 16 (NP - 1) + last). One 64-byte load is a pair of 16 features' weights; one
// vdpbf16ps per row and panel multiplies both elements of the row's broadcast pair and adds the two
// products into the 16 float32 sums.
template <int R, int NP>
inline void micro_dp(const uint32_t* xb, int64_t k2, const uint16_t* p, float* y, int64_t ldy, int64_t n0,
                     int64_t last) {
  __m512 acc[R][NP];
  UNROLL for (int i = 0; i < R; ++i) UNROLL for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t stride = k2 * PANEL * 2;  // bfloat16s per panel
  for (int64_t kp = 0; kp < k2; ++kp) {
    __m512bh w[NP];
    UNROLL for (int j = 0; j < NP; ++j) {
      const uint16_t* wj = p + j * stride + kp * PANEL * 2;
      _mm_prefetch(reinterpret_cast<const char*>(wj) + PREFETCH_BYTES, _MM_HINT_T1);
      w[j] = (__m512bh)_mm512_loadu_si512(wj);
    }
    UNROLL for (int i = 0; i < R; ++i) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xb[i * k2 + kp]));
      UNROLL for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, w[j]);
    }
  }
  UNROLL for (int i = 0; i < R; ++i) UNROLL for (int j = 0; j < NP; ++j) {
    const int64_t cols = j + 1 < NP ? PANEL : last;
    _mm512_mask_storeu_ps(y + i * ldy + n0 + j * PANEL, static_cast<__mmask16>((1u << cols) - 1), acc[i][j]);
  }
}

template <int NP>
void rows_dp(const uint32_t* xb, int64_t m, int64_t k2, const uint16_t* p, float* y, int64_t ldy, int64_t n0,
             int64_t last) {
  int64_t m0 = 0;
  for (; m0 + MR_DP <= m; m0 += MR_DP) micro_dp<MR_DP, NP>(xb + m0 * k2, k2, p, y + m0 * ldy, ldy, n0, last);
  const uint32_t* xr = xb + m0 * k2;
  float* yr = y + m0 * ldy;
  switch (m - m0) {
    case 7: micro_dp<7, NP>(xr, k2, p, yr, ldy, n0, last); break;
    case 6: micro_dp<6, NP>(xr, k2, p, yr, ldy, n0, last); break;
    case 5: micro_dp<5, NP>(xr, k2, p, yr, ldy, n0, last); break;
    case 4: micro_dp<4, NP>(xr, k2, p, yr, ldy, n0, last); break;
    case 3: micro_dp<3, NP>(xr, k2, p, yr, ldy, n0, last); break;
    case 2: micro_dp<2, NP>(xr, k2, p, yr, ldy, n0, last); break;
    case 1: micro_dp<1, NP>(xr, k2, p, yr, ldy, n0, last); break;
    default: break;
  }
}
#endif

}  // namespace

// w [n, k] bfloat16 -> the packed panels (see above), a flat bfloat16 tensor
at::Tensor pack_bf16w(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.device().is_cpu() && w.size(1) % 2 == 0,
              "pack_bf16w: a bfloat16 [n, k] CPU tensor, k even");
  const auto wc = w.contiguous();
  const int64_t n = wc.size(0), k = wc.size(1), panels = (n + PANEL - 1) / PANEL, k2 = k / 2;
  auto packed = at::zeros({panels * k2 * PANEL * 2}, wc.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t j = 0; j < std::min(PANEL, n - p * PANEL); ++j) {
        const uint16_t* row = src + (p * PANEL + j) * k;
        for (int64_t kk = 0; kk < k; ++kk) dst[((p * k2 + kk / 2) * PANEL + j) * 2 + kk % 2] = row[kk];
      }
  });
  return packed;
}

// x [m, k] float32; packed (``pack_bf16w`` of w [n, k]) -> [m, n] float32
at::Tensor linear_bf16w_packed(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "linear_bf16w_packed: x a contiguous float32 [m, k] CPU tensor");
  const int64_t m = x.size(0), k = x.size(1), panels = (n + PANEL - 1) / PANEL, k2 = k / 2;
  TORCH_CHECK(k % 2 == 0, "linear_bf16w_packed: k even");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && packed.numel() == panels * k2 * PANEL * 2,
              "linear_bf16w_packed: packed is pack_bf16w of a [n, k] weight");
  auto y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const float* xp = x.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  // NOTE: threads split the panels; each task runs every row of x against its panels, so a panel
  // (k x 32 bytes: 18 KB at k = 576) is read from memory once and then from L1/L2 for each tile
#ifdef FORESERVE_AVX512BF16
  std::vector<uint16_t> xb(m * k);
  round_rows(xp, m * k, xb.data());
  const uint32_t* xw = reinterpret_cast<const uint32_t*>(xb.data());
  const int64_t groups = (panels + NP_DP - 1) / NP_DP;  // NP_DP panels a tile
  const int64_t grain = std::max<int64_t>(1, 65536 / (k2 * PANEL * 4 * NP_DP));
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t p0 = g * NP_DP, n0 = p0 * PANEL;
      const uint16_t* panel = wp + p0 * k2 * PANEL * 2;
      if (p0 + NP_DP <= panels)
        rows_dp<NP_DP>(xw, m, k2, panel, yp, n, n0, std::min(PANEL, n - (p0 + NP_DP - 1) * PANEL));
      else  // an odd panel left
        rows_dp<1>(xw, m, k2, panel, yp, n, n0, std::min(PANEL, n - n0));
    }
  });
#else
  const int64_t grain = std::max<int64_t>(1, 65536 / (k2 * PANEL * 4));
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const uint16_t* panel = wp + p * k2 * PANEL * 2;
      const int64_t n0 = p * PANEL, cols = std::min(PANEL, n - n0);
      int64_t m0 = 0;
      for (; m0 + MR <= m; m0 += MR) micro<MR>(xp + m0 * k, k, panel, k2, yp + m0 * n, n, n0, cols);
      switch (m - m0) {
        case 5: micro<5>(xp + m0 * k, k, panel, k2, yp + m0 * n, n, n0, cols); break;
        case 4: micro<4>(xp + m0 * k, k, panel, k2, yp + m0 * n, n, n0, cols); break;
        case 3: micro<3>(xp + m0 * k, k, panel, k2, yp + m0 * n, n, n0, cols); break;
        case 2: micro<2>(xp + m0 * k, k, panel, k2, yp + m0 * n, n, n0, cols); break;
        case 1: micro<1>(xp + m0 * k, k, panel, k2, yp + m0 * n, n, n0, cols); break;
        default: break;
      }
    }
  });
#endif
  return y;
}

bool bf16_packed_rounds_rows() {
#ifdef FORESERVE_AVX512BF16
  return true;
#else
  return false;
#endif
}

// The rows' kernel: one row (or no packed copy) the dot products of ``linear_bf16w_dot``, bound by the
// weights' bytes, on the weights as stored; more rows the packed panels. Then the bias, once for both.
at::Tensor linear_bf16w(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                        const c10::optional<at::Tensor>& packed) {
  at::Tensor y;
  if (!packed.has_value() || !packed->defined() || x.dim() != 2 || x.size(0) <= DOT_ROWS) {
    y = linear_bf16w_dot(x, w);
  } else {
    TORCH_CHECK(w.dim() == 2 && x.size(1) == w.size(1), "linear_bf16w: x [m, k] and w [n, k]");
    TORCH_CHECK(w.scalar_type() == at::kBFloat16, "linear_bf16w: float32 x and bfloat16 w only");
    y = linear_bf16w_packed(x, *packed, w.size(0));
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == y.size(1), "linear_bf16w: bias of n elements");
    y.add_(bias->to(at::kFloat).view({1, y.size(1)}));
  }
  return y;
}
