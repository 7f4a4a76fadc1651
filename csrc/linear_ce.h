// linear_cross_entropy's driver (csrc/cpu/linear_ce.cpp), shared by the C++ CPU backend and the CUDA binding: the
// labeled rows, the chunk plan, the three matmuls through ATen and the gradients asked for. A backend supplies
// only the row pass and, where it has one, a matmul that accumulates a low-precision product into fp32.
// Semantics: fastops/_specs/linear_ce.py; the Python twin (reference, Triton): fastops/_lce.py.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <tuple>

#include <ATen/core/Tensor.h>

namespace fastops {

// The reduction argument: torch's Reduction enum, the ints aten's cross_entropy_loss takes.
enum : int64_t { kCeNone = 0, kCeMean = 1, kCeSum = 2 };

// One row pass over a chunk of logits `buf` (rows x V, contiguous): each row's loss in fp32 into `loss`, and
// with `with_grad` the row overwritten by the gradient of loss * scale * row_grad[row] (row_grad undefined: 1).
using CeRows = std::function<void(const at::Tensor& buf, const at::Tensor& target, const at::Tensor& row_grad,
                                  double scale, double eps, bool with_grad, const at::Tensor& loss)>;
// acc (fp32) = a @ b (+ acc unless first), a and b bf16/fp16 matrices (a may be a transposed view), summed in fp32
// inside the matmul. Returns false where the backend has no such matmul for these tensors (the driver then adds
// bf16 products).
using CeAccumulate = std::function<bool(const at::Tensor& acc, const at::Tensor& a, const at::Tensor& b,
                                        bool first)>;
// The two row passes of a vocabulary block `z` (rows x vb, contiguous; the columns v0 .. v0 + vb of each row), for
// the driver's vocabulary blocks (ce_vocab_block): block_stats folds it into each row's running max, sum of exps
// against that max, sum of logits and target logit (fp32 vectors of the rows); block_grad overwrites it by the
// gradient of loss * scale * row_grad[row] (row_grad undefined: 1), given each row's log-sum-exp `lse`.
using CeBlockStats = std::function<void(const at::Tensor& z, int64_t v0, const at::Tensor& target,
                                        const at::Tensor& mx, const at::Tensor& s, const at::Tensor& zs,
                                        const at::Tensor& zt)>;
using CeBlockGrad = std::function<void(const at::Tensor& z, int64_t v0, int64_t v, const at::Tensor& target,
                                       const at::Tensor& row_grad, double scale, double eps, const at::Tensor& lse)>;

struct CeBackend {
  CeRows rows;
  CeAccumulate accumulate;  // may be empty
  bool rows_take_half;      // the row pass reads fp16 buffers itself (else they are widened to fp32 first)
  CeBlockStats block_stats = {};  // both empty: no vocabulary blocks on this backend
  CeBlockGrad block_grad = {};
};

// The rows a chunk holds: equal chunks of at most 512 rows, or all labeled rows in one where those chunks and the
// fp32 grad_weight accumulator they need (4VH bytes, bf16/fp16 with a trainable head) would hold more than half of
// the whole batch's logits. fastops/_lce.py's chunk_rows() is the same function (measured there).
int64_t ce_chunk_rows(int64_t m, int64_t h, int64_t v, int64_t itemsize, bool grad_weight);

// The columns of a vocabulary block where a backend with block passes goes through the vocabulary instead (a
// fourth matmul: the logits once for the log-sum-exp, once more for the gradients), or 0 for chunks of rows.
// fastops/_lce.py's vocab_block() is the same function (measured there).
int64_t ce_vocab_block(int64_t m, int64_t h, int64_t v, int64_t itemsize, bool grad_weight);

// The op's arguments in the schemas' order (fastops/_specs/linear_ce.py; the backward takes grad_loss first), written
// once for the driver and every backend's entry points.
#define FASTOPS_CE_PARAMS                                                                                          \
  const at::Tensor &x, const at::Tensor &weight, const at::Tensor &target, const std::optional<at::Tensor> &bias, \
      int64_t ignore_index, int64_t reduction, double label_smoothing, double normalizer, bool grad_x,           \
      bool grad_weight, bool grad_bias, int64_t chunk_rows
#define FASTOPS_CE_ARGS \
  x, weight, target, bias, ignore_index, reduction, label_smoothing, normalizer, grad_x, grad_weight, grad_bias, chunk_rows
using CeForward = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;  // loss, grad_x, grad_weight, grad_bias
using CeBackward = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

CeForward ce_forward(FASTOPS_CE_PARAMS, const CeBackend& backend);
CeBackward ce_backward(const at::Tensor& grad_loss, FASTOPS_CE_PARAMS, const CeBackend& backend);

// A backend's two entry points, linear_cross_entropy and linear_cross_entropy_backward, around the driver with
// `backend` (a CeBackend); the statements after it run first in each (a device guard, say).
#define FASTOPS_CE_ENTRY_POINTS(backend, ...)                                                  \
  CeForward linear_cross_entropy(FASTOPS_CE_PARAMS) {                                          \
    __VA_ARGS__;                                                                               \
    return ce_forward(FASTOPS_CE_ARGS, backend);                                               \
  }                                                                                            \
  CeBackward linear_cross_entropy_backward(const at::Tensor& grad_loss, FASTOPS_CE_PARAMS) {   \
    __VA_ARGS__;                                                                               \
    return ce_backward(grad_loss, FASTOPS_CE_ARGS, backend);                                   \
  }
#define FASTOPS_CE_DECLARE_ENTRY_POINTS                      \
  CeForward linear_cross_entropy(FASTOPS_CE_PARAMS);         \
  CeBackward linear_cross_entropy_backward(const at::Tensor& grad_loss, FASTOPS_CE_PARAMS)

// The row pass in ATen ops, for the dtypes no kernel takes (float64) on any device.
void ce_rows_aten(const at::Tensor& buf, const at::Tensor& target, const at::Tensor& row_grad, double scale,
                  double eps, bool with_grad, const at::Tensor& loss);

namespace cuda {
// csrc/cuda/linear_ce.cu's row pass over `rows` rows of `v` logits at z (kind 0: fp32, 1: bf16, 2: fp16), on the
// cudaStream_t `stream`; returns its cudaError_t. No CUDA type here: the CPU build includes this header.
int ce_rows(int kind, void* z, int64_t rows, int64_t v, const int64_t* target, const float* row_grad, float scale,
            float eps, bool with_grad, float* loss, void* stream);
}  // namespace cuda

namespace cpu {
// How the CPU backend adds partial products up in fp32: "mkl", "avx512bf16", "onednn" or "product"
// (csrc/cpu/linear_ce.cpp).
const char* ce_accumulate();
// acc (fp32) = a @ b (+ acc unless first) the way named `how`; false where that way does not take these tensors and
// bf16 products were added instead. Raises where `how` is unknown or does not serve on this machine. For the tests.
bool ce_accumulate_with(const std::string& how, const at::Tensor& acc, const at::Tensor& a, const at::Tensor& b,
                        bool first);
// The C++ CPU backend (csrc/cpu/linear_ce.cpp).
FASTOPS_CE_DECLARE_ENTRY_POINTS;
}  // namespace cpu

namespace cuda_host {
// The driver around csrc/cuda/ce_math.cuh's per-row math compiled for the host (csrc/cpu/ce_cuda_host.cpp): what
// the CPU tests run in place of the CUDA kernel.
FASTOPS_CE_DECLARE_ENTRY_POINTS;
}  // namespace cuda_host

}  // namespace fastops
