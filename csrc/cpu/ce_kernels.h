// The boundary between linear_ce.cpp (chunks, matmuls through ATen, threads) and the row pass of
// linear_cross_entropy (ce_isa.h, compiled once per ISA inside kernels_{default,avx2,avx512}.cpp). Only raw
// pointers and plain scalars cross it, as for kernels.h.
#pragma once

#include <cstdint>

#include "kernels.h"

namespace fastops {
namespace cpu {

struct CeKernels {
  const char* name;
  // Rows [begin, end) of one chunk of logits (row i at logits + i * v elements, dtype kFloat or kBFloat16):
  // loss[i] = (1 - eps)(lse - z[t]) + eps (lse - mean z), computed in fp32; with with_grad, the row is overwritten
  // in place by the gradient of loss[i] * scale * (row_grad ? row_grad[i] : 1) with respect to its logits.
  void (*rows)(void* logits, Dtype dt, int64_t v, const int64_t* target, const float* row_grad, float scale,
               float eps, bool with_grad, float* loss, int64_t begin, int64_t end);
  // The two passes of a chunk of vocabulary (linear_ce.cpp's vocabulary blocks): rows [begin, end) of a block of
  // vb logits a row (row i at z + i * vb, the row's columns v0 .. v0 + vb).
  // block_stats folds the block into each row's running max mx[i], sum of exp(z - mx[i]) s[i] and sum of logits
  // zs[i], and stores zt[i] = z[target[i]] where the target falls in the block.
  void (*block_stats)(const void* z, Dtype dt, int64_t vb, int64_t v0, const int64_t* target, float* mx, float* s,
                      float* zs, float* zt, int64_t begin, int64_t end);
  // block_grad overwrites the block by the gradient of loss[i] * scale * (row_grad ? row_grad[i] : 1), the row's
  // log-sum-exp lse[i] known (v: the whole vocabulary, for the smoothing's eps / v).
  void (*block_grad)(void* z, Dtype dt, int64_t vb, int64_t v0, int64_t v, const int64_t* target,
                     const float* row_grad, float scale, float eps, const float* lse, int64_t begin, int64_t end);
};

extern const CeKernels kCe_isa_default;
#ifdef FASTOPS_MULTI_ISA
extern const CeKernels kCe_isa_avx2;
extern const CeKernels kCe_isa_avx512;
#endif

// The row pass of the ISA kernels() picked (linear_ce.cpp).
const CeKernels& ce_kernels();

}  // namespace cpu
}  // namespace fastops
