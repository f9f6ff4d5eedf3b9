// RoPE on a step's queries and keys and the store of its keys and values into the paged pool, in
// one pass: what took the runner ~16 small torch ops a layer (slices, rotate-half, casts, two
// index_copy_) and ~2 ms of a 24 ms batch-1 decode step of SmolLM2-135M here.
//
// qkv [T, (H + 2 KVH) * D] float32, the fused q, k, v projection's output; cos, sin [T, D] float32;
// slots [T] int64, each token's flat slot in the pool; k_pool, v_pool one layer of the pool,
// [blocks, block, KVH, D], float32 or bfloat16. Returns [T, H + KVH, D] float32: the rotated queries
// then keys. The rotation is HF Llama's rotate-half, x * cos + rotate_half(x) * sin, each product
// rounded apart as torch's ops round them (no fused multiply-add), so its values are torch's.
#include "kernels.h"

namespace {

template <typename KV>
__attribute__((optimize("fp-contract=off"))) void rope_row(
    const float* in, const float* cos, const float* sin, int64_t heads, int64_t kv_heads, int64_t dim,
    float* qk, KV* k_slot, KV* v_slot) {
  const int64_t half = dim / 2, nq = heads + kv_heads;
  for (int64_t h = 0; h < nq; ++h) {
    const float* x = in + h * dim;
    float* o = qk + h * dim;
    for (int64_t d = 0; d < dim; ++d) {
      const float rot = d < half ? -x[d + half] : x[d - half];
      const float a = x[d] * cos[d];
      const float b = rot * sin[d];
      o[d] = a + b;
    }
    if (h >= heads) {
      KV* k = k_slot + (h - heads) * dim;
      for (int64_t d = 0; d < dim; ++d) k[d] = static_cast<KV>(o[d]);
    }
  }
  const float* v = in + nq * dim;
  for (int64_t e = 0; e < kv_heads * dim; ++e) v_slot[e] = static_cast<KV>(v[e]);
}

}  // namespace

at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& slots, const at::Tensor& k_pool, const at::Tensor& v_pool,
                      int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes() && k_pool.size(2) == kv_heads,
              "rope_store: pools [blocks, block, KVH, D]");
  const int64_t dim = k_pool.size(3), T = qkv.size(0), nq = heads + kv_heads;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (nq + kv_heads) * dim && dim % 2 == 0, "rope_store: qkv [T, (H + 2 KVH) * D]");
  TORCH_CHECK(cos.sizes() == at::IntArrayRef({T, dim}) && sin.sizes() == cos.sizes() && slots.numel() == T,
              "rope_store: cos, sin [T, D] and slots [T]");
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
              slots.scalar_type() == at::kLong && v_pool.scalar_type() == k_pool.scalar_type() &&
              (k_pool.scalar_type() == at::kFloat || k_pool.scalar_type() == at::kBFloat16),
              "rope_store: float32 qkv, cos, sin; int64 slots; float32 or bfloat16 pools");
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() && slots.is_contiguous() &&
              k_pool.is_contiguous() && v_pool.is_contiguous(), "rope_store: contiguous tensors only");
  TORCH_CHECK(qkv.device().is_cpu() && k_pool.device().is_cpu(), "rope_store: CPU tensors only");
  const int64_t capacity = k_pool.size(0) * k_pool.size(1);
  const int64_t* s_p = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(s_p[t] >= 0 && s_p[t] < capacity, "rope_store: slot outside the pool");
  auto qk = at::empty({T, nq, dim}, qkv.options());
  const float* in = qkv.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  float* out = qk.data_ptr<float>();
  const int64_t row = kv_heads * dim;
  auto run = [&](auto* k_p, auto* v_p) {
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        rope_row(in + t * (nq + kv_heads) * dim, c + t * dim, sn + t * dim, heads, kv_heads, dim, out + t * nq * dim,
                 k_p + s_p[t] * row, v_p + s_p[t] * row);
    });
  };
  if (k_pool.scalar_type() == at::kFloat) {
    run(k_pool.data_ptr<float>(), v_pool.data_ptr<float>());
  } else {
    run(k_pool.data_ptr<at::BFloat16>(), v_pool.data_ptr<at::BFloat16>());
  }
  return qk;
}
