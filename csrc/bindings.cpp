// The one Python module, fastops._C: `cpp` (C++ CPU kernels), `cuda` (CUDA builds only), WITH_CUDA and
// cpu_capability(). fastops._backend looks the ops up by name on the submodules.
#include <torch/extension.h>

#include "cpu/kernels.h"
#include "fastops.h"
#include "linear_ce.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::module_ cpp = m.def_submodule("cpp", "C++ CPU kernels (csrc/cpu)");
  cpp.def("adam_step_", &fastops::cpu::adam_step_, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"),
          py::arg("exp_avg_sqs"), py::arg("max_exp_avg_sqs"), py::arg("state_steps"), py::arg("master_params"),
          py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
          py::arg("amsgrad"), py::arg("maximize"), py::arg("decoupled"), py::arg("grad_scale"),
          py::arg("found_inf"), py::call_guard<py::gil_scoped_release>());
  cpp.def("adam_step_lowp_", &fastops::cpu::adam_step_lowp_, py::arg("params"), py::arg("grads"),
          py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("exp_avg_absmax"), py::arg("exp_avg_sq_absmax"),
          py::arg("state_steps"), py::arg("master_params"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
          py::arg("eps"), py::arg("weight_decay"), py::arg("maximize"), py::arg("decoupled"), py::arg("seed"),
          py::arg("grad_scale"), py::arg("found_inf"), py::call_guard<py::gil_scoped_release>());
  cpp.def("sgd_step_", &fastops::cpu::sgd_step_, py::arg("params"), py::arg("grads"), py::arg("momentum_buffers"),
          py::arg("master_params"), py::arg("lr"), py::arg("weight_decay"), py::arg("momentum"),
          py::arg("dampening"), py::arg("nesterov"), py::arg("maximize"), py::arg("is_first_step"),
          py::arg("grad_scale"), py::arg("found_inf"), py::call_guard<py::gil_scoped_release>());
  cpp.def("unscale_check_", &fastops::cpu::unscale_check_, py::arg("grads"), py::arg("found_inf"),
          py::arg("inv_scale"), py::call_guard<py::gil_scoped_release>());
  cpp.def("grad_stats", &fastops::cpu::grad_stats, py::arg("grads"), py::arg("inv_scale") = py::none(),
          py::call_guard<py::gil_scoped_release>());

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

  // linear_cross_entropy (csrc/cpu/linear_ce.cpp), and the same driver around the CUDA row pass's per-row math
  // compiled for the host (csrc/cpu/ce_cuda_host.cpp), which the CPU tests run against the reference.
  cpp.def("linear_cross_entropy", &fastops::cpu::linear_cross_entropy, py::call_guard<py::gil_scoped_release>());
  cpp.def("linear_cross_entropy_backward", &fastops::cpu::linear_cross_entropy_backward,
          py::call_guard<py::gil_scoped_release>());
  cpp.def("linear_ce_chunk_rows", &fastops::ce_chunk_rows, py::arg("m"), py::arg("h"), py::arg("v"),
          py::arg("itemsize"), py::arg("grad_weight"));
  py::module_ ce_host = m.def_submodule("cuda_host", "csrc/cuda's linear_cross_entropy row math, host-compiled");
  ce_host.def("linear_cross_entropy", &fastops::cuda_host::linear_cross_entropy,
              py::call_guard<py::gil_scoped_release>());
  ce_host.def("linear_cross_entropy_backward", &fastops::cuda_host::linear_cross_entropy_backward,
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
