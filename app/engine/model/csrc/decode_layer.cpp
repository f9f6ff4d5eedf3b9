// One Llama decoder layer of a decode step (every row a sequence's next token), in one call: the
// residual add and RMSNorm, the fused q-k-v projection, RoPE with the K/V store, paged attention,
// the output projection, the second add and norm, the fused gate-up projection, SiLU(gate) * up and
// the down projection. bfloat16 weights through ``linear_bf16w`` (the CPUs without native bfloat16,
// few rows; ``packed``: the four weights' ``pack_bf16w``, or none); the same kernels the runner's
// Python forward calls one by one, so the answer is the same to the bit.
//
// NOTE: at one row a layer's kernels take ~0.8 ms; the ~14 torch calls between them (slices, views,
// chunk, silu, mul, allocations), each a few microseconds through Python and the dispatcher, were
// 3-4 ms of a 33 ms step of SmolLM2-135M (30 layers) here.
#include "kernels.h"


#include <cmath>

// gate_up [T, 2 I] float32 (gate, then up) -> silu(gate) * up [T, I]
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.scalar_type() == at::kFloat &&
              gate_up.is_contiguous() && gate_up.device().is_cpu(), "silu_mul: contiguous float32 [T, 2 I] on the CPU");
  const int64_t T = gate_up.size(0), inner = gate_up.size(1) / 2;
  auto out = at::empty({T, inner}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = in + t * 2 * inner;
      const float* u = g + inner;
      float* y = o + t * inner;
#pragma omp simd
      for (int64_t i = 0; i < inner; ++i) y[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

// h [T, hidden] float32, the residual stream: delta (the previous layer's MLP output, or None) and
// then this layer's attention output are added in place. Weights: RMSNorm [hidden] float32;
// qkv [(H + 2 KVH) D, hidden], o [hidden, H D], gate_up [2 I, hidden], down [hidden, I] bfloat16,
// no biases. cos, sin [T, D]; slots [T]; one layer's pools; tables, lens as ``paged_decode``'s.
// Returns the MLP's output [T, hidden], the next layer's delta.
at::Tensor decode_layer(at::Tensor& h, const c10::optional<at::Tensor>& delta, const at::Tensor& input_norm,
                        const at::Tensor& qkv_w, const at::Tensor& o_w, const at::Tensor& post_norm,
                        const at::Tensor& gate_up_w, const at::Tensor& down_w, double eps,
                        const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                        const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& tables,
                        const at::Tensor& lens, int64_t heads, int64_t kv_heads, double scale,
                        const std::vector<at::Tensor>& packed) {
  const int64_t T = h.size(0), dim = k_pool.size(3);
  TORCH_CHECK(tables.size(0) == T, "decode_layer: every row is a decode row");
  TORCH_CHECK(packed.empty() || packed.size() == 4, "decode_layer: packed holds the 4 weights' pack_bf16w, or none");
  const c10::optional<at::Tensor> none;
  auto lin = [&](const at::Tensor& x, const at::Tensor& w, size_t i) {
    return linear_bf16w(x, w, none, packed.empty() ? none : c10::optional<at::Tensor>(packed[i]));
  };
  auto x = add_rms_norm(h, delta, input_norm, eps);
  auto qk = rope_store(lin(x, qkv_w, 0), cos, sin, slots, k_pool, v_pool, heads, kv_heads);
  auto attn = paged_decode(qk.narrow(1, 0, heads).contiguous(), k_pool, v_pool, tables, lens, scale, c10::nullopt);
  x = add_rms_norm(h, lin(attn.view({T, heads * dim}), o_w, 1), post_norm, eps);
  return lin(silu_mul(lin(x, gate_up_w, 2)), down_w, 3);
}
