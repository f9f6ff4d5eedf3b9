// The residual add and the RMSNorm that follows it, in one op: h += delta (in place), then
// x = weight * (h / sqrt(mean(h^2) + eps)). torch's rms_norm on a CPU is a chain of small ops (pow,
// mean, add, rsqrt, mul, mul), ~35 us a call on one decode row here; a step of SmolLM2-135M makes
// 61 such calls and 60 residual adds.
#include "kernels.h"

#include <cmath>

// h [T, n] float32 (updated in place when delta is given), delta [T, n] float32 or None,
// weight [n] float32 -> [T, n] float32
at::Tensor add_rms_norm(at::Tensor& h, const c10::optional<at::Tensor>& delta, const at::Tensor& weight,
                        double eps) {
  TORCH_CHECK(h.dim() == 2 && weight.dim() == 1 && weight.size(0) == h.size(1), "add_rms_norm: h [T, n], weight [n]");
  TORCH_CHECK(h.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "add_rms_norm: float32 only");
  TORCH_CHECK(h.is_contiguous() && weight.is_contiguous() && h.device().is_cpu(), "add_rms_norm: contiguous CPU tensors");
  const bool add = delta.has_value() && delta->defined();
  if (add)
    TORCH_CHECK(delta->sizes() == h.sizes() && delta->scalar_type() == at::kFloat && delta->is_contiguous(),
                "add_rms_norm: delta like h");
  const int64_t T = h.size(0), n = h.size(1);
  auto out = at::empty_like(h);
  float* h_p = h.data_ptr<float>();
  const float* d_p = add ? delta->data_ptr<float>() : nullptr;
  const float* w_p = weight.data_ptr<float>();
  float* o_p = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* row = h_p + t * n;
      if (add) {
        const float* d = d_p + t * n;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) row[i] += d[i];
      }
      double sq = 0.0;
#pragma omp simd reduction(+ : sq)
      for (int64_t i = 0; i < n; ++i) sq += static_cast<double>(row[i]) * row[i];
      const float inv = 1.f / std::sqrt(static_cast<float>(sq / n) + static_cast<float>(eps));
      float* o = o_p + t * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = w_p[i] * (row[i] * inv);
    }
  });
  return out;
}
