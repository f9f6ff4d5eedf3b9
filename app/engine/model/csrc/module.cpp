// The Python module of foreserve's CPU kernels: paged_decode.cpp, bf16_linear.cpp, bf16_packed.cpp,
// rope_store.cpp, rms_norm.cpp and decode_layer.cpp.
#include <torch/csrc/utils/pybind.h>  // pybind11 with torch's tensor casters, not all of torch/extension.h

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // NOTE: the GIL is released: the engine steps on its own thread while the replica's event loop
  // streams tokens, as it does during torch's own ops
  m.def("paged_decode", &paged_decode, "decode attention over the paged KV pool (CPU); starts: each row's "
        "first position (a sliding window)", py::arg("q"), py::arg("k_pool"), py::arg("v_pool"), py::arg("tables"),
        py::arg("lens"), py::arg("scale"), py::arg("starts") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("linear_bf16w", &linear_bf16w, "x [m, k] float32 times bfloat16 w [n, k] transposed (+ bias) (CPU); "
        "packed: pack_bf16w(w), for more than 1 row", py::arg("x"), py::arg("w"), py::arg("bias") = py::none(),
        py::arg("packed") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("pack_bf16w", &pack_bf16w, "bfloat16 w [n, k] packed in panels for linear_bf16w (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("bf16_packed_rounds_rows", &bf16_packed_rounds_rows,
        "whether linear_bf16w rounds rows to bfloat16 on the packed panels (AVX512-BF16's vdpbf16ps)");
  m.def("add_rms_norm", &add_rms_norm, "h += delta in place, then RMSNorm(h) * weight (CPU, float32)",
        py::arg("h"), py::arg("delta"), py::arg("weight"), py::arg("eps"), py::call_guard<py::gil_scoped_release>());
  m.def("rope_store", &rope_store, "RoPE on q and k of a fused qkv, k and v stored into the paged pool (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate-up output [T, 2 I] (CPU, float32)",
        py::call_guard<py::gil_scoped_release>());
  m.def("decode_layer", &decode_layer, "one Llama decoder layer of a decode step, bfloat16 weights (CPU)",
        py::arg("h"), py::arg("delta"), py::arg("input_norm"), py::arg("qkv_w"), py::arg("o_w"), py::arg("post_norm"),
        py::arg("gate_up_w"), py::arg("down_w"), py::arg("eps"), py::arg("cos"), py::arg("sin"), py::arg("slots"),
        py::arg("k_pool"), py::arg("v_pool"), py::arg("tables"), py::arg("lens"), py::arg("heads"), py::arg("kv_heads"),
        py::arg("scale"), py::arg("packed") = std::vector<at::Tensor>{}, py::call_guard<py::gil_scoped_release>());
}
