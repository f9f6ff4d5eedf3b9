// Decode attention that reads K/V straight from the paged pool, on the CPU: float32 queries and
// output, K/V in float32 or bfloat16 (read as float32; bfloat16 halves the bytes, which is what
// decode attention is bound by).
//
// The torch path gathers each sequence's blocks into a contiguous buffer and calls SDPA: three
// passes over the K/V bytes (read, write, read) and an SDPA kernel built for long queries, where a
// decode row has one. Here each sequence's blocks are read once, a token's row of all KV heads at a
// time (the pool's [block, token, kv_head, dim] layout), into scores for every query head; then a
// softmax and one more pass over V. With AVX-512, heads of 64 or 128 elements take a wider path
// (``attend_part_wide``): 16 tokens at a time, each K and V row widened once for the query heads
// that share it, and the rows 32 tokens on fetched ahead (2.0-2.2x the AVX2 path's speed at 8-32
// sequences of 300 tokens here; ``python -m loadtests.bench.attention_microbench``).
#include "kernels.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define FORESERVE_AVX512 1
#endif
#define UNROLL _Pragma("GCC unroll 16")

namespace {

// 8 K/V elements widened to float32 (a bfloat16 is the top half of a float32).
#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// exp(x) for x <= 0 (a score minus the largest): 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2 and
// p exp's Taylor polynomial of degree 6 (relative error ~2e-7). x is clamped at -87: exp(-87) is
// 1.6e-38, next to nothing beside the largest score's 1, and never a denormal (slow to multiply).
// NOTE: glibc's expf, called once per score and head, was 15% of the call at 512 tokens here.
inline __m256 exp_nonpos(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

// s[t] = exp(s[t] - top) in place; returns their sum
inline float exp_shifted(float* s, int64_t len, float top) {
  int64_t t = 0;
  float total = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 m = _mm256_set1_ps(top);
  __m256 sum = _mm256_setzero_ps();
  for (; t + 8 <= len; t += 8) {
    const __m256 e = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(s + t), m));
    _mm256_storeu_ps(s + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  for (float v : lanes) total += v;
#endif
  for (; t < len; ++t) {
    s[t] = std::exp(s[t] - top);
    total += s[t];
  }
  return total;
}

// q . k over dim elements
template <typename KV>
inline float dot(const float* q, const KV* k, int64_t dim) {
#if defined(__AVX2__) && defined(__FMA__)
  if (dim % 16 == 0) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (int64_t x = 0; x < dim; x += 16) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + x), load8(k + x), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + x + 8), load8(k + x + 8), a1);
    }
    const __m256 a = _mm256_add_ps(a0, a1);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
  }
#endif
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t x = 0; x < dim; ++x) sum += q[x] * static_cast<float>(k[x]);
  return sum;
}

// acc += p * v over dim elements
template <typename KV>
inline void axpy(float* acc, float p, const KV* v, int64_t dim) {
#if defined(__AVX2__) && defined(__FMA__)
  if (dim % 8 == 0) {
    const __m256 pv = _mm256_set1_ps(p);
    for (int64_t x = 0; x < dim; x += 8)
      _mm256_storeu_ps(acc + x, _mm256_fmadd_ps(pv, load8(v + x), _mm256_loadu_ps(acc + x)));
    return;
  }
#endif
#pragma omp simd
  for (int64_t x = 0; x < dim; ++x) acc[x] += p * static_cast<float>(v[x]);
}

// The row of position ``pos`` in a sequence's blocks (``table``): ``row`` elements, every KV head of
// a token, in the pool's [block, token, kv_head, dim] layout.
template <typename KV>
inline const KV* kv_row(const KV* pool, const int64_t* table, int64_t pos, int64_t block, int64_t row) {
  return pool + (table[pos / block] * block + pos % block) * row;
}

// All query heads of one sequence over its tokens [t0, t1): per head the running max ``m``, the sum
// of exp(score - m) ``z`` and the unnormalized sum of exp(score - m) * V ``acc`` ([heads, dim]).
// An empty range leaves m = -FLT_MAX, z = 0, acc = 0.
template <typename KV>
void attend_part(const float* q, const KV* k_pool, const KV* v_pool, const int64_t* table, int64_t t0, int64_t t1,
                 int64_t heads, int64_t kv_heads, int64_t dim, int64_t block, float scale,
                 std::vector<float>& scores, float* m, float* z, float* acc) {
  const int64_t rep = heads / kv_heads, len = std::max<int64_t>(0, t1 - t0);
  const int64_t row = kv_heads * dim;
  scores.resize(heads * std::max<int64_t>(1, len));
  for (int64_t h = 0; h < heads; ++h) m[h] = -FLT_MAX;
  for (int64_t t = 0; t < len; ++t) {
    const int64_t pos = t0 + t;
    const KV* k_row = kv_row(k_pool, table, pos, block, row);
    for (int64_t h = 0; h < heads; ++h) {
      const float score = dot(q + h * dim, k_row + (h / rep) * dim, dim) * scale;
      scores[h * len + t] = score;
      m[h] = std::max(m[h], score);
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    float* s = scores.data() + h * len;
    z[h] = exp_shifted(s, len, m[h]);
  }
  std::fill(acc, acc + heads * dim, 0.f);
  for (int64_t t = 0; t < len; ++t) {
    const int64_t pos = t0 + t;
    const KV* v_row = kv_row(v_pool, table, pos, block, row);
    for (int64_t h = 0; h < heads; ++h) axpy(acc + h * dim, scores[h * len + t], v_row + (h / rep) * dim, dim);
  }
}

#ifdef FORESERVE_AVX512
// The wide path fetches K and V rows into L2 this many tokens ahead. A sequence's blocks lie
// anywhere in the pool, and the hardware prefetcher loses the stream at every block (6 KB here).
// At 300 cached tokens, batch 16, one thread, 30 layers' pools (out of cache), AMD EPYC (Zen 4),
// decode attention read 4.7-5.8 GB/s of K/V without and 9.3-11.2 GB/s with; the AVX2 path with the
// same prefetches gained nothing there (``python -m loadtests.bench.attention_microbench``).
constexpr int64_t PREFETCH_TOKENS = 32;

// ``kv_row``'s row fetched into L2.
template <typename KV>
inline void prefetch_row(const KV* pool, const int64_t* table, int64_t pos, int64_t block, int64_t row) {
  const char* p = reinterpret_cast<const char*>(kv_row(pool, table, pos, block, row));
  for (int64_t b = 0; b < row * static_cast<int64_t>(sizeof(KV)); b += 64) __builtin_prefetch(p + b, 0, 2);
}

// 16 K/V elements widened to float32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// v[0..16) -> one vector whose lane t is the sum of v[t]'s 16 lanes: pairs, then quads, of vectors
// are interleaved and added, then 128-bit lanes (45 instructions for 16 sums, where a horizontal sum
// each took about 8).
inline __m512 sum_lanes16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  UNROLL for (int i = 0; i < 8; ++i)  // lanes (x, y, x, y) per 128 bits
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  UNROLL for (int i = 0; i < 4; ++i)  // (x, y, z, w) per 128 bits
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  UNROLL for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// ``attend_part`` for heads of 16 * D16 elements, REP query heads per KV head, with AVX-512. Tokens
// go 16 at a time: each KV head's K row is widened once for its REP query heads, whose products
// stay 16 lanes wide and are summed 16 tokens at a time (``sum_lanes16``); then each V row is widened
// once and added into the REP heads' sums, held in registers over the 16 tokens.
// NOTE: at 300 cached tokens, batch 16, one thread, SmolLM2-135M (9 heads, 3 KV heads of 64), a
// horizontal sum per score and V widened and the sums loaded and stored per head and token made
// decode attention as slow as all the step's linears (perf: 29% of the process each). Since, the
// call waits on its K/V reads: the K products as vdpbf16ps on the query rounded to bfloat16 (no
// widening, half the multiplies) timed the same in attention_microbench (b16 cold 12.4-13.2 ms
// against 11.9-13.6, AMD Zen 4), with perf's samples on the prefetches (17%) and V's loads (13%).
template <typename KV, int D16, int REP>
void attend_part_wide(const float* q, const KV* k_pool, const KV* v_pool, const int64_t* table, int64_t t0,
                      int64_t t1, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block, float scale,
                      std::vector<float>& scores, float* m, float* z, float* acc) {
  const int64_t len = std::max<int64_t>(0, t1 - t0), padded = (len + 15) / 16 * 16;
  const int64_t row = kv_heads * dim;
  scores.resize(heads * std::max<int64_t>(16, padded));
  for (int64_t h = 0; h < heads; ++h) m[h] = -FLT_MAX;
  const KV* rows[16];
  // The rows of tokens [tb, tb + nb) into ``rows``; the rows PREFETCH_TOKENS on fetched into L2.
  auto gather = [&](const KV* pool, int64_t tb, int64_t nb) {
    for (int64_t t = 0; t < nb; ++t) rows[t] = kv_row(pool, table, t0 + tb + t, block, row);
    for (int64_t pos = t0 + tb + PREFETCH_TOKENS; pos < std::min(t1, t0 + tb + nb + PREFETCH_TOKENS); ++pos)
      prefetch_row(pool, table, pos, block, row);
  };
  for (int64_t pos = t0; pos < std::min(t1, t0 + PREFETCH_TOKENS); ++pos) prefetch_row(k_pool, table, pos, block, row);
  __m512 part[REP][16];
  for (int64_t tb = 0; tb < len; tb += 16) {
    const int64_t nb = std::min<int64_t>(16, len - tb);
    const __mmask16 valid = static_cast<__mmask16>((1u << nb) - 1);
    gather(k_pool, tb, nb);
    for (int64_t g = 0; g < kv_heads; ++g) {
      __m512 qv[REP][D16];
      UNROLL for (int r = 0; r < REP; ++r) UNROLL for (int c = 0; c < D16; ++c)
        qv[r][c] = _mm512_loadu_ps(q + (g * REP + r) * dim + 16 * c);
      for (int64_t t = 0; t < nb; ++t) {
        __m512 kv[D16];
        UNROLL for (int c = 0; c < D16; ++c) kv[c] = load16(rows[t] + g * dim + 16 * c);
        UNROLL for (int r = 0; r < REP; ++r) {
          __m512 s = _mm512_mul_ps(qv[r][0], kv[0]);
          UNROLL for (int c = 1; c < D16; ++c) s = _mm512_fmadd_ps(qv[r][c], kv[c], s);
          part[r][t] = s;
        }
      }
      for (int64_t t = nb; t < 16; ++t) UNROLL for (int r = 0; r < REP; ++r) part[r][t] = _mm512_setzero_ps();
      UNROLL for (int r = 0; r < REP; ++r) {
        const int64_t h = g * REP + r;
        const __m512 sc = _mm512_mul_ps(sum_lanes16(part[r]), _mm512_set1_ps(scale));
        _mm512_mask_storeu_ps(scores.data() + h * padded + tb, valid, sc);
        m[h] = std::max(m[h], _mm512_mask_reduce_max_ps(valid, sc));
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) z[h] = exp_shifted(scores.data() + h * padded, len, m[h]);
  std::fill(acc, acc + heads * dim, 0.f);
  for (int64_t tb = 0; tb < len; tb += 16) {
    const int64_t nb = std::min<int64_t>(16, len - tb);
    gather(v_pool, tb, nb);
    for (int64_t g = 0; g < kv_heads; ++g) {
      __m512 sums[REP][D16];
      UNROLL for (int r = 0; r < REP; ++r) UNROLL for (int c = 0; c < D16; ++c)
        sums[r][c] = _mm512_loadu_ps(acc + (g * REP + r) * dim + 16 * c);
      for (int64_t t = 0; t < nb; ++t) {
        __m512 vv[D16];
        UNROLL for (int c = 0; c < D16; ++c) vv[c] = load16(rows[t] + g * dim + 16 * c);
        UNROLL for (int r = 0; r < REP; ++r) {
          const __m512 p = _mm512_set1_ps(scores[(g * REP + r) * padded + tb + t]);
          UNROLL for (int c = 0; c < D16; ++c) sums[r][c] = _mm512_fmadd_ps(p, vv[c], sums[r][c]);
        }
      }
      UNROLL for (int r = 0; r < REP; ++r) UNROLL for (int c = 0; c < D16; ++c)
        _mm512_storeu_ps(acc + (g * REP + r) * dim + 16 * c, sums[r][c]);
    }
  }
}
#endif

template <typename KV>
using AttendPart = void (*)(const float*, const KV*, const KV*, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                            int64_t, int64_t, float, std::vector<float>&, float*, float*, float*);

// The widest ``attend_part`` for heads of ``dim`` elements, ``rep`` query heads per KV head.
template <typename KV>
AttendPart<KV> pick_attend_part(int64_t dim, int64_t rep) {
#ifdef FORESERVE_AVX512
  if (dim == 64 && rep == 1) return attend_part_wide<KV, 4, 1>;
  if (dim == 64 && rep == 2) return attend_part_wide<KV, 4, 2>;
  if (dim == 64 && rep == 3) return attend_part_wide<KV, 4, 3>;
  if (dim == 64 && rep == 4) return attend_part_wide<KV, 4, 4>;
  if (dim == 128 && rep == 1) return attend_part_wide<KV, 8, 1>;
  if (dim == 128 && rep == 2) return attend_part_wide<KV, 8, 2>;
#else
  (void)dim;
  (void)rep;
#endif
  return attend_part<KV>;
}

}  // namespace

// q [n, H, D]; k_pool, v_pool [num_blocks, block, KVH, D] (one layer); tables [n, max_blocks] int64;
// lens [n] int64 (tokens to attend to, this step's included); starts [n] int64 or none (a sliding
// window's first position, 0 without one) -> [n, H, D]: row i attends to positions [starts[i], lens[i])
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                        const at::Tensor& tables, const at::Tensor& lens, double scale,
                        const c10::optional<at::Tensor>& starts) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes(), "paged_decode: bad shapes");
  TORCH_CHECK(q.device().is_cpu() && k_pool.device().is_cpu() && v_pool.device().is_cpu() && tables.device().is_cpu() &&
              lens.device().is_cpu(), "paged_decode: CPU tensors only");
  const auto kv_type = k_pool.scalar_type();
  TORCH_CHECK(q.scalar_type() == at::kFloat && v_pool.scalar_type() == kv_type &&
              (kv_type == at::kFloat || kv_type == at::kBFloat16),
              "paged_decode: float32 queries, float32 or bfloat16 K/V only");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong, "paged_decode: int64 tables");
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous() && tables.is_contiguous() &&
              lens.is_contiguous(), "paged_decode: contiguous tensors only");
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t block = k_pool.size(1), kv_heads = k_pool.size(2);
  TORCH_CHECK(k_pool.size(3) == dim && kv_heads > 0 && heads % kv_heads == 0, "paged_decode: head counts disagree");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == n && lens.numel() == n, "paged_decode: one table row per query");
  const int64_t max_blocks = tables.size(1);
  const int64_t* len_p = lens.data_ptr<int64_t>();
  const int64_t* t_p = tables.data_ptr<int64_t>();
  std::vector<int64_t> zeros;
  const int64_t* start_p = nullptr;
  if (starts.has_value()) {
    TORCH_CHECK(starts->scalar_type() == at::kLong && starts->numel() == n && starts->is_contiguous() &&
                starts->device().is_cpu(), "paged_decode: starts must be [n] int64 on the CPU");
    start_p = starts->data_ptr<int64_t>();
  } else {
    zeros.assign(n, 0);
    start_p = zeros.data();
  }
  const int64_t num_blocks = k_pool.size(0);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(len_p[i] >= 1 && len_p[i] <= max_blocks * block, "paged_decode: length outside the table");
    TORCH_CHECK(start_p[i] >= 0 && start_p[i] < len_p[i], "paged_decode: start outside [0, length)");
    for (int64_t b = start_p[i] / block; b < (len_p[i] + block - 1) / block; ++b) {
      const int64_t id = t_p[i * max_blocks + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "paged_decode: block id outside the pool");
    }
  }
  auto out = at::empty_like(q);
  const float* q_p = q.data_ptr<float>();
  float* o_p = out.data_ptr<float>();
  // Each sequence's tokens are cut into ``parts`` ranges, one task each (flash-decoding's split):
  // a batch smaller than twice the threads still uses every thread, each reading whole K/V rows
  // (all KV heads of a token) in order. The ranges' partial softmaxes are merged after.
  // NOTE: at batch 1 and 512 tokens, 30 layers apart (K/V out of L2), this took the call from
  // ~210 us (a task per KV head: 128-byte reads 384 bytes apart) to ~90 us on 2 threads here.
  int64_t max_len = 0;
  for (int64_t i = 0; i < n; ++i) max_len = std::max(max_len, len_p[i] - start_p[i]);
  const int64_t threads = at::get_num_threads();
  const int64_t parts = std::max<int64_t>(1, std::min((2 * threads + n - 1) / n, max_len / 64));
  std::vector<float> part_m(n * parts * heads), part_z(n * parts * heads), part_acc(n * parts * heads * dim);
  auto run = [&](auto* k_p, auto* v_p) {
    const auto attend = pick_attend_part<std::remove_const_t<std::remove_pointer_t<decltype(k_p)>>>(dim, heads / kv_heads);
    at::parallel_for(0, n * parts, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t u = begin; u < end; ++u) {
        // Rows come sorted by length: alternate ends so each thread's contiguous share mixes long and short.
        const int64_t s = u / parts, p = u % parts;
        const int64_t i = (s % 2 == 0) ? s / 2 : n - 1 - s / 2;
        const int64_t span = (len_p[i] - start_p[i] + parts - 1) / parts;
        const int64_t slot = i * parts + p;
        attend(q_p + i * heads * dim, k_p, v_p, t_p + i * max_blocks, start_p[i] + p * span,
               std::min(len_p[i], start_p[i] + (p + 1) * span),
               heads, kv_heads, dim, block, static_cast<float>(scale), scores, part_m.data() + slot * heads,
               part_z.data() + slot * heads, part_acc.data() + slot * heads * dim);
      }
    });
  };
  if (kv_type == at::kFloat) {
    run(k_pool.data_ptr<float>(), v_pool.data_ptr<float>());
  } else {
    run(k_pool.data_ptr<at::BFloat16>(), v_pool.data_ptr<at::BFloat16>());
  }
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t h = 0; h < heads; ++h) {
      float top = -FLT_MAX;
      for (int64_t p = 0; p < parts; ++p) top = std::max(top, part_m[(i * parts + p) * heads + h]);
      float total = 0.f;
      float* o = o_p + (i * heads + h) * dim;
      std::fill(o, o + dim, 0.f);
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t slot = (i * parts + p) * heads + h;
        if (part_z[slot] == 0.f) continue;  // an empty range
        const float w = std::exp(part_m[slot] - top);
        total += w * part_z[slot];
        axpy(o, w, part_acc.data() + slot * dim, dim);
      }
      const float inv = 1.f / total;
      for (int64_t x = 0; x < dim; ++x) o[x] *= inv;
    }
  }
  return out;
}
