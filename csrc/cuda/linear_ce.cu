// linear_cross_entropy's row pass on CUDA: one block of kCeThreads threads a row of a chunk of logits. Each thread
// folds its logits (j = tid, tid + kCeThreads, ...: a warp's loads coalesce) into a running max, sum of exps and sum
// of logits, the block merges the partials in a tree in shared memory, thread 0 writes the row's loss, and with a
// gradient wanted every thread overwrites its logits with their gradient. The math is ce_math.cuh's, which
// csrc/cpu/ce_cuda_host.cpp runs on the host in the same order for the CPU tests. The matmuls around it are the
// binding's (linear_ce_binding.cpp: csrc/linear_ce.h's driver, cuBLAS through ATen). Only CUDA headers here.
#include <cstdint>

#include <cuda_runtime.h>

#include "ce_math.cuh"

namespace fastops {
namespace cuda {
namespace {

using ce::kCeThreads;

template <typename T>
__global__ void __launch_bounds__(kCeThreads)
    ce_rows_kernel(T* z, int64_t v, const int64_t* target, const float* row_grad, float scale, float eps,
                   bool with_grad, float* loss) {
  __shared__ ce::Stats parts[kCeThreads];
  __shared__ float row_lse;
  const int64_t row = blockIdx.x;
  const int tid = static_cast<int>(threadIdx.x);
  T* zr = z + row * v;
  parts[tid] = ce::stats_part(zr, v, tid, kCeThreads);
  __syncthreads();
  for (int stride = kCeThreads / 2; stride > 0; stride >>= 1) {
    if (tid < stride) ce::merge_step(parts, tid, stride);
    __syncthreads();
  }
  const int64_t t = target[row];
  if (tid == 0) {
    const float lse = ce::row_lse(parts[0]);
    loss[row] = ce::row_loss(lse, ce::load(zr, t), parts[0].zsum, v, eps);  // before any thread writes z[t]
    row_lse = lse;
  }
  if (!with_grad) return;
  __syncthreads();
  const float c = row_grad != nullptr ? ce::ce_mul(scale, row_grad[row]) : scale;
  ce::grad_part(zr, v, t, row_lse, c, eps, tid, kCeThreads);
}

template <typename T>
void launch(void* z, int64_t rows, int64_t v, const int64_t* target, const float* row_grad, float scale, float eps,
            bool with_grad, float* loss, cudaStream_t stream) {
  ce_rows_kernel<T><<<static_cast<unsigned int>(rows), kCeThreads, 0, stream>>>(
      static_cast<T*>(z), v, target, row_grad, scale, eps, with_grad, loss);
}

}  // namespace

int ce_rows(int kind, void* z, int64_t rows, int64_t v, const int64_t* target, const float* row_grad, float scale,
            float eps, bool with_grad, float* loss, void* stream) {
  if (rows == 0) return cudaSuccess;
  if (rows > 2147483647) return cudaErrorInvalidValue;  // one block a row; the driver's chunks are far smaller
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (kind) {
    case 0:
      launch<float>(z, rows, v, target, row_grad, scale, eps, with_grad, loss, s);
      break;
    case 1:
      launch<ce::Bf16>(z, rows, v, target, row_grad, scale, eps, with_grad, loss, s);
      break;
    case 2:
      launch<ce::F16>(z, rows, v, target, row_grad, scale, eps, with_grad, loss, s);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace fastops
