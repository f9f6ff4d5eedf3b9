// The entry points of foreserve's CPU kernels, one per source file, for module.cpp's bindings and
// for decode_layer.cpp, which chains them.
//
// The kernels include ATen's tensor class and the few operators they call, not torch/extension.h
// (the whole C++ API and pybind11), which took most of the build: 60 s or more a file here against
// 10-15 s. module.cpp, which binds them to Python, includes pybind11 with torch's tensor casters.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                        const at::Tensor& tables, const at::Tensor& lens, double scale,
                        const c10::optional<at::Tensor>& starts);
at::Tensor linear_bf16w_dot(const at::Tensor& x, const at::Tensor& w);
at::Tensor pack_bf16w(const at::Tensor& w);
bool bf16_packed_rounds_rows();
at::Tensor linear_bf16w_packed(const at::Tensor& x, const at::Tensor& packed, int64_t n);
at::Tensor linear_bf16w(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                        const c10::optional<at::Tensor>& packed);
at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& slots, const at::Tensor& k_pool, const at::Tensor& v_pool,
                      int64_t heads, int64_t kv_heads);
at::Tensor add_rms_norm(at::Tensor& h, const c10::optional<at::Tensor>& delta, const at::Tensor& weight,
                        double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor decode_layer(at::Tensor& h, const c10::optional<at::Tensor>& delta, const at::Tensor& input_norm,
                        const at::Tensor& qkv_w, const at::Tensor& o_w, const at::Tensor& post_norm,
                        const at::Tensor& gate_up_w, const at::Tensor& down_w, double eps,
                        const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                        const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& tables,
                        const at::Tensor& lens, int64_t heads, int64_t kv_heads, double scale,
                        const std::vector<at::Tensor>& packed);
