// The entry points of foreserve's CPU kernels, one per source file, for module.cpp's bindings and
// for decode_layer.cpp, which chains them.
#pragma once
#include <torch/extension.h>

torch::Tensor paged_decode(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                           const torch::Tensor& tables, const torch::Tensor& lens, double scale);
torch::Tensor linear_bf16w_dot(const torch::Tensor& x, const torch::Tensor& w);
torch::Tensor pack_bf16w(const torch::Tensor& w);
torch::Tensor linear_bf16w_packed(const torch::Tensor& x, const torch::Tensor& packed, int64_t n);
torch::Tensor linear_bf16w(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                           const c10::optional<torch::Tensor>& packed);
torch::Tensor rope_store(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                         const torch::Tensor& slots, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                         int64_t heads, int64_t kv_heads);
torch::Tensor add_rms_norm(torch::Tensor& h, const c10::optional<torch::Tensor>& delta, const torch::Tensor& weight,
                           double eps);
torch::Tensor silu_mul(const torch::Tensor& gate_up);
torch::Tensor decode_layer(torch::Tensor& h, const c10::optional<torch::Tensor>& delta, const torch::Tensor& input_norm,
                           const torch::Tensor& qkv_w, const torch::Tensor& o_w, const torch::Tensor& post_norm,
                           const torch::Tensor& gate_up_w, const torch::Tensor& down_w, double eps,
                           const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& slots,
                           const torch::Tensor& k_pool, const torch::Tensor& v_pool, const torch::Tensor& tables,
                           const torch::Tensor& lens, int64_t heads, int64_t kv_heads, double scale,
                           const std::vector<torch::Tensor>& packed);
