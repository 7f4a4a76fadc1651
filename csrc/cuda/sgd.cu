// fastops.sgd_step_ on CUDA: one launch per param dtype over a chunk table (kernels.cuh).
//
// The math per element is fastops/reference.py's (torch.optim.SGD's for-loop) in fp32, in the same order,
// with the roundings spelled out as in adam.cu: fmaf exactly where torch's CPU kernels fuse (every add with
// alpha), __f*_rn elsewhere so that nvcc contracts nothing else.
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels.cuh"

namespace fastops {
namespace cuda {
namespace {

using detail::Elem;

// MODE: SgdArgs::momentum_mode. buf is read only when MODE == 2 and written when MODE != 0.
template <int MODE, bool NESTEROV>
__device__ __forceinline__ void sgd_math(float& p, float g, float& buf, const SgdArgs& a, float scale, float neg_lr) {
  if (a.has_grad_scale) g = __fdiv_rn(g, scale);
  if (a.maximize) g = -g;
  if (a.weight_decay != 0.0f) g = fmaf(p, a.weight_decay, g);
  if (MODE != 0) {
    buf = MODE == 1 ? g : fmaf(g, a.one_minus_dampening, __fmul_rn(buf, a.momentum));
    g = NESTEROV ? fmaf(buf, a.momentum, g) : buf;
  }
  p = fmaf(g, neg_lr, p);
}

template <typename T, int MODE, bool NESTEROV, bool MASTER>
__global__ void __launch_bounds__(kThreads) sgd_kernel(const SgdArgs a) {
  // A skipped step touches nothing.
  if (a.found_inf != nullptr && *a.found_inf != 0.0f) return;
  const float neg_lr = -(a.lr_ptr != nullptr ? *a.lr_ptr : a.lr);
  const float scale = a.grad_scale_ptr != nullptr ? *a.grad_scale_ptr : a.grad_scale;

  for (int64_t c = blockIdx.x; c < a.n_chunks; c += gridDim.x) {
    const int64_t* row = a.tensors + a.chunks[2 * c] * kSgdCols;
    const int64_t start = a.chunks[2 * c + 1] * kChunkSize;
    T* p = reinterpret_cast<T*>(row[kSgdParam]);
    const T* g = reinterpret_cast<const T*>(row[kSgdGrad]);
    float* buf = reinterpret_cast<float*>(row[kSgdBuf]);
    float* w = reinterpret_cast<float*>(row[kSgdMaster]);
    const int64_t numel = row[kSgdNumel];
    const int64_t end = numel < start + kChunkSize ? numel : start + kChunkSize;

    // start is a multiple of 65536 elements, so the chunk is as aligned as the tensor's base pointer.
    const bool vec = detail::aligned(p, 4 * sizeof(T)) && detail::aligned(g, 4 * sizeof(T)) &&
                     (MODE == 0 || detail::aligned(buf, 16)) && (!MASTER || detail::aligned(w, 16));
    int64_t scalar_from = start;
    if (vec) {
      const int64_t vec_end = start + (end - start) / 4 * 4;
      for (int64_t i = start + 4 * static_cast<int64_t>(threadIdx.x); i < vec_end;
           i += 4 * static_cast<int64_t>(blockDim.x)) {
        float pf[4], gf[4], bf[4];
        if (MASTER) {
          detail::load4<false>(w + i, pf);
        } else {
          detail::load4<false>(p + i, pf);
        }
        detail::load4<true>(g + i, gf);
        if (MODE == 2) detail::load4<false>(buf + i, bf);
#pragma unroll
        for (int k = 0; k < 4; ++k) sgd_math<MODE, NESTEROV>(pf[k], gf[k], bf[k], a, scale, neg_lr);
        if (MODE != 0) detail::store4(buf + i, bf);
        if (MASTER) detail::store4(w + i, pf);
        detail::store4(p + i, pf);
      }
      scalar_from = vec_end;
    }
    // The unaligned case, and the last numel % 4 elements of an aligned tensor.
    for (int64_t i = scalar_from + threadIdx.x; i < end; i += blockDim.x) {
      float pf = MASTER ? w[i] : Elem<T>::load(p[i]);
      float bf = MODE == 2 ? buf[i] : 0.0f;
      sgd_math<MODE, NESTEROV>(pf, detail::load_ro(g + i), bf, a, scale, neg_lr);
      if (MODE != 0) buf[i] = bf;
      if (MASTER) w[i] = pf;
      p[i] = Elem<T>::store(pf);
    }
  }
}

template <typename T, int MODE, bool NESTEROV>
void launch_mode(const SgdArgs& a, int max_blocks, cudaStream_t stream) {
  auto kernel = a.has_master ? sgd_kernel<T, MODE, NESTEROV, true> : sgd_kernel<T, MODE, NESTEROV, false>;
  detail::launch_resident(kernel, a, max_blocks, stream);
}

template <typename T>
void launch(const SgdArgs& a, int max_blocks, cudaStream_t stream) {
  // Nesterov needs momentum; without it there is only one kernel.
  switch (a.momentum_mode * 2 + (a.nesterov ? 1 : 0)) {
    case 2: launch_mode<T, 1, false>(a, max_blocks, stream); break;
    case 3: launch_mode<T, 1, true>(a, max_blocks, stream); break;
    case 4: launch_mode<T, 2, false>(a, max_blocks, stream); break;
    case 5: launch_mode<T, 2, true>(a, max_blocks, stream); break;
    default: launch_mode<T, 0, false>(a, max_blocks, stream); break;
  }
}

}  // namespace

cudaError_t sgd_step(ScalarKind kind, const SgdArgs& args, int max_blocks, cudaStream_t stream) {
  if (args.n_chunks == 0) return cudaSuccess;
  if (args.momentum_mode < 0 || args.momentum_mode > 2) return cudaErrorInvalidValue;
  return detail::launch_for_kind(kind,
                                 [&](auto t) { launch<typename decltype(t)::type>(args, max_blocks, stream); });
}

}  // namespace cuda
}  // namespace fastops
