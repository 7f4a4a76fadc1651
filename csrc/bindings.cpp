// The one Python module, fastops._C: `cpp` (C++ CPU kernels), `checks` (the ops' argument checks alone), `cuda`
// (CUDA builds only), `cuda_math` (the CUDA kernels' math on CPU tensors, for the tests), WITH_CUDA and
// cpu_capability(). fastops._backend looks the ops up by name on the submodules;
// each op there takes its arguments by name and runs its check and its kernel in one call
// (csrc/generated/op_bindings.h).
#include <torch/extension.h>

#include "cpu/kernels.h"
#include "fastops.h"
#include "generated/op_bindings.h"
#include "linear_ce.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::module_ cpp = m.def_submodule("cpp", "C++ CPU kernels (csrc/cpu)");
  fastops::def_adam_step_(cpp, fastops::cpu::adam_step_);
  fastops::def_adam_step_lowp_(cpp, fastops::cpu::adam_step_lowp_);
  fastops::def_sgd_step_(cpp, fastops::cpu::sgd_step_);
  fastops::def_unscale_check_(cpp, fastops::cpu::unscale_check_);
  fastops::def_grad_stats(cpp, fastops::cpu::grad_stats);
  fastops::def_dropout(cpp, fastops::cpu::dropout);
  fastops::def_checks(m.def_submodule("checks", "each op's argument check alone (csrc/cpu/checks.cpp)"));
  py::module_ cuda_math = m.def_submodule("cuda_math", "the CUDA kernels' math on CPU tensors (tests)");
  fastops::cuda::register_cuda_math(cuda_math);

  // The 8-bit maps' fp32 constants as the kernels hold them, for the test that they are fastops/_quant.py's.
  cpp.def("quant_constants", [](bool is_signed) {
    const fastops::cpu::QuantMap& q = fastops::cpu::quant_map(is_signed);
    return py::dict(py::arg("qmap") = std::vector<float>(q.qmap, q.qmap + 256),
                    py::arg("T") = std::vector<float>(q.T, q.T + 8), py::arg("P") = std::vector<float>(q.P, q.P + 7),
                    py::arg("F") = std::vector<float>(q.F, q.F + 7), py::arg("n") = std::vector<int>(q.n, q.n + 7));
  }, py::arg("signed"));
  cpp.def("sr_key", &fastops::cpu::sr_key, py::arg("seed"), py::arg("index"));

  cpp.def("cpu_cache_enable", &fastops::cpu::cpu_cache_enable, py::arg("limit_bytes"),
          "Keep freed CPU blocks of 8 MiB and more (at most limit_bytes) for reuse; see csrc/cpu/cache.cpp.");
  cpp.def("cpu_cache_stats", [] {
    const fastops::cpu::CacheStats s = fastops::cpu::cpu_cache_stats();
    return py::dict(py::arg("hits") = s.hits, py::arg("misses") = s.misses, py::arg("released") = s.released,
                    py::arg("cached_bytes") = s.cached_bytes, py::arg("limit_bytes") = s.limit_bytes);
  });
  cpp.def("cpu_cache_empty", &fastops::cpu::cpu_cache_empty, "Give every cached CPU block back to the OS.");

  // linear_cross_entropy (csrc/cpu/linear_ce.cpp), and in cuda_math the same driver around the CUDA row pass's
  // per-row math compiled for the host (csrc/cpu/ce_cuda_host.cpp), which the CPU tests run against the reference.
  cpp.def("linear_cross_entropy", &fastops::cpu::linear_cross_entropy, py::call_guard<py::gil_scoped_release>());
  cpp.def("linear_cross_entropy_backward", &fastops::cpu::linear_cross_entropy_backward,
          py::call_guard<py::gil_scoped_release>());
  cpp.def("linear_ce_chunk_rows", &fastops::ce_chunk_rows, py::arg("m"), py::arg("h"), py::arg("v"),
          py::arg("itemsize"), py::arg("grad_weight"));
  cpp.def("linear_ce_vocab_block", &fastops::ce_vocab_block, py::arg("m"), py::arg("h"), py::arg("v"),
          py::arg("itemsize"), py::arg("grad_weight"));
  cpp.def("linear_ce_accumulate", [] { return std::string(fastops::cpu::ce_accumulate()); },
          "How partial products add up in fp32 on the CPU: \"mkl\", \"avx512bf16\", \"onednn\" or \"product\" "
          "(csrc/cpu/linear_ce.cpp).");
  cpp.def("linear_ce_accumulate_with", &fastops::cpu::ce_accumulate_with, py::arg("how"), py::arg("acc"),
          py::arg("a"), py::arg("b"), py::arg("first"),
          "acc = a @ b (+ acc unless first) the way named how; False where bf16 products served instead.");
  cuda_math.def("linear_cross_entropy", &fastops::cuda_host::linear_cross_entropy,
                py::call_guard<py::gil_scoped_release>());
  cuda_math.def("linear_cross_entropy_backward", &fastops::cuda_host::linear_cross_entropy_backward,
                py::call_guard<py::gil_scoped_release>());

#ifdef WITH_CUDA
  m.attr("WITH_CUDA") = true;
  fastops::cuda::register_bindings(m.def_submodule("cuda", "CUDA kernels (csrc/cuda)"));
#else
  m.attr("WITH_CUDA") = false;
#endif
  m.def("cpu_capability", [] { return std::string(fastops::cpu::capability()); },
        "The ISA of the CPU kernel set picked at load time: \"avx512\", \"avx2\" or \"default\".");
}
