// fastops.dropout on CUDA: one grid-stride pass, each thread an element at a time (the hash is a few integer ops
// against 4-8 bytes of traffic an element).
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "dropout_math.cuh"
#include "kernels.cuh"

namespace fastops {
namespace cuda {
namespace {

template <typename T>
__global__ void __launch_bounds__(kThreads)
    dropout_kernel(const T* __restrict__ x, T* __restrict__ out, int64_t n, uint32_t key, uint32_t threshold,
                   float scale) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < n;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[k] = detail::Elem<T>::store(detail::Elem<T>::load(x[k]) * detail::dropout_factor(key, k, threshold, scale));
  }
}

}  // namespace

cudaError_t dropout(ScalarKind kind, const void* x, void* out, int64_t n, uint32_t key, uint32_t threshold,
                    float scale, int max_blocks, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int64_t want = (n + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(want < max_blocks ? want : max_blocks);
  return detail::launch_for_kind(kind, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dropout_kernel<T><<<blocks, kThreads, 0, stream>>>(static_cast<const T*>(x), static_cast<T*>(out), n, key,
                                                        threshold, scale);
  });
}

}  // namespace cuda
}  // namespace fastops
