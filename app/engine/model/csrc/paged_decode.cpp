// Decode attention that reads K/V straight from the paged pool, on the CPU: float32 queries and
// output, K/V in float32 or bfloat16 (read as float32; bfloat16 halves the bytes, which is what
// decode attention is bound by).
//
// The torch path gathers each sequence's blocks into a contiguous buffer and calls SDPA: three
// passes over the K/V bytes (read, write, read) and an SDPA kernel built for long queries, where a
// decode row has one. Here each sequence's blocks are read once, a token's row of all KV heads at a
// time (the pool's [block, token, kv_head, dim] layout), into scores for every query head; then a
// softmax and one more pass over V.
#include "kernels.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

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

// All query heads of one sequence over its tokens [t0, t1): per head the running max ``m``, the sum
// of exp(score - m) ``z`` and the unnormalized sum of exp(score - m) * V ``acc`` ([heads, dim]).
// An empty range leaves m = -FLT_MAX, z = 0, acc = 0.
template <typename KV>
void attend_part(const float* q, const KV* k_pool, const KV* v_pool, const int64_t* table, int64_t t0, int64_t t1,
                 int64_t heads, int64_t kv_heads, int64_t dim, int64_t block, float scale,
                 std::vector<float>& scores, float* m, float* z, float* acc) {
  const int64_t rep = heads / kv_heads, len = std::max<int64_t>(0, t1 - t0);
  const int64_t row = kv_heads * dim, block_stride = block * row;
  scores.resize(heads * std::max<int64_t>(1, len));
  for (int64_t h = 0; h < heads; ++h) m[h] = -FLT_MAX;
  for (int64_t t = 0; t < len; ++t) {
    const int64_t pos = t0 + t;
    const KV* k_row = k_pool + table[pos / block] * block_stride + (pos % block) * row;
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
    const KV* v_row = v_pool + table[pos / block] * block_stride + (pos % block) * row;
    for (int64_t h = 0; h < heads; ++h) axpy(acc + h * dim, scores[h * len + t], v_row + (h / rep) * dim, dim);
  }
}

}  // namespace

// q [n, H, D]; k_pool, v_pool [num_blocks, block, KVH, D] (one layer); tables [n, max_blocks] int64;
// lens [n] int64 (tokens to attend to, this step's included) -> [n, H, D]
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                        const at::Tensor& tables, const at::Tensor& lens, double scale) {
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
  const int64_t num_blocks = k_pool.size(0);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(len_p[i] >= 1 && len_p[i] <= max_blocks * block, "paged_decode: length outside the table");
    for (int64_t b = 0; b < (len_p[i] + block - 1) / block; ++b) {
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
  for (int64_t i = 0; i < n; ++i) max_len = std::max(max_len, len_p[i]);
  const int64_t threads = at::get_num_threads();
  const int64_t parts = std::max<int64_t>(1, std::min((2 * threads + n - 1) / n, max_len / 64));
  std::vector<float> part_m(n * parts * heads), part_z(n * parts * heads), part_acc(n * parts * heads * dim);
  auto run = [&](auto* k_p, auto* v_p) {
    at::parallel_for(0, n * parts, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t u = begin; u < end; ++u) {
        // Rows come sorted by length: alternate ends so each thread's contiguous share mixes long and short.
        const int64_t s = u / parts, p = u % parts;
        const int64_t i = (s % 2 == 0) ? s / 2 : n - 1 - s / 2;
        const int64_t span = (len_p[i] + parts - 1) / parts;
        const int64_t slot = i * parts + p;
        attend_part(q_p + i * heads * dim, k_p, v_p, t_p + i * max_blocks, p * span, std::min(len_p[i], (p + 1) * span),
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
