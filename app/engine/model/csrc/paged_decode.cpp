// Decode attention that reads K/V straight from the paged pool, on the CPU: float32 queries and
// output, K/V in float32 or bfloat16 (read as float32; bfloat16 halves the bytes, which is what
// decode attention is bound by).
//
// The torch path gathers each sequence's blocks into a contiguous buffer and calls SDPA: three
// passes over the K/V bytes (read, write, read) and an SDPA kernel built for long queries, where a
// decode row has one. Here each sequence's blocks are read once, a token's row of all KV heads at a
// time (the pool's [block, token, kv_head, dim] layout), into scores for every query head; then a
// softmax and one more pass over V. One sequence per task.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <vector>

namespace {

template <typename KV>
void attend_one(const float* q, const KV* k_pool, const KV* v_pool, const int64_t* table,
                int64_t len, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block, float scale,
                std::vector<float>& scores, std::vector<float>& acc, float* out) {
  const int64_t rep = heads / kv_heads;
  const int64_t row = kv_heads * dim, block_stride = block * row;
  scores.resize(heads * len);
  std::vector<float> top(heads, -FLT_MAX);
  for (int64_t t = 0; t < len; ++t) {
    const KV* k_row = k_pool + table[t / block] * block_stride + (t % block) * row;
    for (int64_t h = 0; h < heads; ++h) {
      const KV* k = k_row + (h / rep) * dim;
      const float* qh = q + h * dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t x = 0; x < dim; ++x) dot += qh[x] * static_cast<float>(k[x]);
      dot *= scale;
      scores[h * len + t] = dot;
      top[h] = std::max(top[h], dot);
    }
  }
  std::vector<float> total(heads);
  for (int64_t h = 0; h < heads; ++h) {
    float* s = scores.data() + h * len;
    const float m = top[h];
    float z = 0.f;
#pragma omp simd reduction(+ : z)
    for (int64_t t = 0; t < len; ++t) {
      s[t] = std::exp(s[t] - m);
      z += s[t];
    }
    total[h] = z;
  }
  acc.assign(heads * dim, 0.f);
  for (int64_t t = 0; t < len; ++t) {
    const KV* v_row = v_pool + table[t / block] * block_stride + (t % block) * row;
    for (int64_t h = 0; h < heads; ++h) {
      const float p = scores[h * len + t];
      const KV* v = v_row + (h / rep) * dim;
      float* a = acc.data() + h * dim;
#pragma omp simd
      for (int64_t x = 0; x < dim; ++x) a[x] += p * static_cast<float>(v[x]);
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    const float inv = 1.f / total[h];
    for (int64_t x = 0; x < dim; ++x) out[h * dim + x] = acc[h * dim + x] * inv;
  }
}

}  // namespace

// q [n, H, D]; k_pool, v_pool [num_blocks, block, KVH, D] (one layer); tables [n, max_blocks] int64;
// lens [n] int64 (tokens to attend to, this step's included) -> [n, H, D]
torch::Tensor paged_decode(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                           const torch::Tensor& tables, const torch::Tensor& lens, double scale) {
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
  auto out = torch::empty_like(q);
  const float* q_p = q.data_ptr<float>();
  float* o_p = out.data_ptr<float>();
  auto run = [&](auto* k_p, auto* v_p) {
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores, acc;
      for (int64_t u = begin; u < end; ++u) {
        // Rows come sorted by length: alternate ends so each thread's contiguous share mixes long and short.
        const int64_t i = (u % 2 == 0) ? u / 2 : n - 1 - u / 2;
        attend_one(q_p + i * heads * dim, k_p, v_p, t_p + i * max_blocks, len_p[i], heads, kv_heads, dim, block,
                   static_cast<float>(scale), scores, acc, o_p + i * heads * dim);
      }
    });
  };
  if (kv_type == at::kFloat) {
    run(k_pool.data_ptr<float>(), v_pool.data_ptr<float>());
  } else {
    run(k_pool.data_ptr<at::BFloat16>(), v_pool.data_ptr<at::BFloat16>());
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // NOTE: the GIL is released: the engine steps on its own thread while the replica's event loop
  // streams tokens, as it does during torch's own ops
  m.def("paged_decode", &paged_decode, "decode attention over the paged KV pool (CPU)",
        py::call_guard<py::gil_scoped_release>());
}
