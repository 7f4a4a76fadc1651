// The torch side of linear_cross_entropy on CUDA (compiled only in CUDA builds): csrc/linear_ce.h's driver with
// linear_ce.cu's row pass and cuBLAS's bf16/fp16 x bf16/fp16 -> fp32 matmul for grad_weight over several chunks.
// The arguments arrive checked (fastops/_ops.py runs the spec's check once); registered on fastops._C.cuda by
// binding.cpp's register_bindings.
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "../fastops.h"
#include "../linear_ce.h"

namespace fastops {
namespace cuda {
namespace {

void rows(const at::Tensor& buf, const at::Tensor& target, const at::Tensor& row_grad, double scale, double eps,
          bool with_grad, const at::Tensor& loss) {
  const at::ScalarType t = buf.scalar_type();
  if (t == at::kDouble) {
    ce_rows_aten(buf, target, row_grad, scale, eps, with_grad, loss);
    return;
  }
  const int kind = t == at::kFloat ? 0 : t == at::kBFloat16 ? 1 : 2;
  C10_CUDA_CHECK(static_cast<cudaError_t>(ce_rows(
      kind, buf.data_ptr(), buf.size(0), buf.size(1), target.const_data_ptr<int64_t>(),
      row_grad.defined() ? row_grad.const_data_ptr<float>() : nullptr, static_cast<float>(scale),
      static_cast<float>(eps), with_grad, loss.data_ptr<float>(), at::cuda::getCurrentCUDAStream().stream())));
}

bool accumulate(const at::Tensor& acc, const at::Tensor& a, const at::Tensor& b, bool first) {
  at::Tensor out = acc;
  at::addmm_out(out, acc, a, b, at::kFloat, first ? 0 : 1, 1);
  return true;
}

const CeBackend& backend() {
  static const CeBackend b{rows, accumulate, true};
  return b;
}

FASTOPS_CE_ENTRY_POINTS(backend(), TORCH_CHECK(x.is_cuda(), "fastops.linear_cross_entropy: the CUDA backend takes "
                                                 "CUDA tensors");
                        const c10::cuda::CUDAGuard guard(x.device()))

}  // namespace

void register_linear_ce(pybind11::module_ m) {
  namespace py = pybind11;
  m.def("linear_cross_entropy", &linear_cross_entropy, py::call_guard<py::gil_scoped_release>());
  m.def("linear_cross_entropy_backward", &linear_cross_entropy_backward, py::call_guard<py::gil_scoped_release>());
}

}  // namespace cuda
}  // namespace fastops
