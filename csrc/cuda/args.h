// What the CUDA kernels take (csrc/cuda/*.cu) and the binding fills (binding.cpp): the table layout every launcher
// walks and the scalars of each launch. Plain C++ (no CUDA or torch header), so the host build of the kernels' math
// (csrc/cuda_math.cpp) takes the same structs.
//
// Every launcher walks a chunk table, as apex's multi_tensor_apply does: entry c is (tensor index, chunk
// index), the chunk covering elements [chunk * kChunkSize, min(numel, (chunk + 1) * kChunkSize)) of that
// tensor, and each tensor's pointers and numel sit in a row of a per-tensor table. Both tables are int64
// arrays in device memory, so one launch covers any number of tensors, and the binding caches them.
#pragma once

#include <cstdint>
#include <vector>

#include "state_format.h"

namespace fastops {
namespace cuda {

enum class ScalarKind : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// 65536 elements a chunk, as apex: a 1B-param model is 15k chunks (a 240 KiB chunk table), and at most
// one partly filled chunk per tensor.
constexpr int64_t kChunkSize = 65536;
// 512 threads x 4 elements a trip: 32 trips per full chunk.
constexpr int kThreads = 512;

// The columns every Adam per-tensor table starts with (adam_step_ and adam_step_lowp_): an op's own columns
// follow from kAdamOwn, and numel is last. Absent pointers (master without master params) are 0.
enum AdamCol : int {
  kAdamParam = 0,
  kAdamGrad = 1,
  kAdamExpAvg = 2,
  kAdamExpAvgSq = 3,
  kAdamMaster = 4,
  kAdamStep = 5,  // float32 step counter, already incremented for this step
  kAdamOwn = 6,
};

// adam_step_'s own column: max_exp_avg_sq (0 without amsgrad).
enum FullCol : int { kAdamMaxExpAvgSq = kAdamOwn, kAdamNumel = kAdamOwn + 1, kAdamCols = kAdamOwn + 2 };

// adam_step_lowp_'s own columns. Absmax pointers are 0 with bf16 states. kLowpIndex: the tensor's position in
// the op's lists (the stochastic-rounding key's input).
enum LowpCol : int {
  kLowpExpAvgAbsmax = kAdamOwn,
  kLowpExpAvgSqAbsmax = kAdamOwn + 1,
  kLowpIndex = kAdamOwn + 2,
  kLowpNumel = kAdamOwn + 3,
  kLowpCols = kAdamOwn + 4,
};

// Columns of the SGD per-tensor table. Absent pointers (momentum buffer without momentum, master without
// master params) are 0.
enum SgdCol : int { kSgdParam = 0, kSgdGrad = 1, kSgdBuf = 2, kSgdMaster = 3, kSgdNumel = 4, kSgdCols = 5 };

// Columns of the grad table (unscale_check_, grad_stats).
enum GradCol : int { kGradPtr = 0, kGradNumel = 1, kGradCols = 2 };

// Scalars of one Adam launch, shared by adam_step_ and adam_step_lowp_. Pointers are device fp32 scalars read in
// the kernel (what CUDA-graph capture needs); nullptr means "use the value field".
struct AdamCommonArgs {
  const int64_t* tensors;  // [n_tensors][kAdamCols or kLowpCols]
  const int64_t* chunks;   // [n_chunks][2]
  int64_t n_chunks;
  const float* lr_ptr;
  float lr;
  float decay;  // 1 - lr * weight_decay, used when lr_ptr is null
  const float* grad_scale_ptr;
  float grad_scale;
  bool has_grad_scale;
  const float* found_inf;  // the kernel does nothing when *found_inf != 0; nullptr: never skips
  float beta2;
  float one_minus_beta2;  // fp32(1 - beta2 in fp64), as torch passes value=1 - beta2
  float lerp_weight;      // fp32(1 - beta1)
  bool lerp_small;        // |lerp_weight| < 0.5: torch.lerp's choice of formula
  double beta1_64;        // the bias corrections are computed in fp64 (adam_math.cuh)
  double beta2_64;
  float eps;
  float weight_decay;
  double weight_decay64;  // for 1 - lr * weight_decay when lr is read in the kernel
  int wd_mode;            // 0 none, 1 L2 (Adam), 2 decoupled (AdamW)
  bool maximize;
  bool has_master;
};

struct AdamArgs : AdamCommonArgs {
  bool amsgrad;
};

struct AdamLowpArgs : AdamCommonArgs {
  StateFormat format;  // kEightBit (uint8 codes + absmax) or kBf16
  uint32_t seed;       // low 32 bits of the op's seed
};

// Scalars of one SGD launch; pointers as in AdamArgs.
struct SgdArgs {
  const int64_t* tensors;  // [n_tensors][kSgdCols]
  const int64_t* chunks;   // [n_chunks][2]
  int64_t n_chunks;
  const float* lr_ptr;
  float lr;
  const float* grad_scale_ptr;
  float grad_scale;
  bool has_grad_scale;
  const float* found_inf;  // the kernel does nothing when *found_inf != 0; nullptr: never skips
  float weight_decay;
  float momentum;
  float one_minus_dampening;  // fp32(1 - dampening in fp64), as torch passes alpha=1 - dampening
  int momentum_mode;          // 0 no momentum, 1 first step (buf = grad), 2 buf = momentum*buf + (1-d)*grad
  bool nesterov;
  bool maximize;
  bool has_master;
};

// The chunk table of a per-tensor table `rows` (n x cols, numel last): (tensor index, chunk index) pairs, tensor by
// tensor.
inline std::vector<int64_t> chunk_list(const std::vector<int64_t>& rows, int64_t cols) {
  std::vector<int64_t> out;
  const int64_t n = static_cast<int64_t>(rows.size()) / cols;
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t k = 0; k * kChunkSize < rows[r * cols + cols - 1]; ++k) {
      out.push_back(r);
      out.push_back(k);
    }
  }
  return out;
}

}  // namespace cuda
}  // namespace fastops
