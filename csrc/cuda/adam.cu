// fastops.adam_step_ on CUDA: one launch per param dtype over a chunk table (kernels.cuh).
//
// The math per element is fastops/reference.py's in fp32, in the same order, with the roundings spelled
// out (__f*_rn): nvcc contracts a * b + c into an FMA wherever it likes (-fmad=true is its default), and the
// intrinsics keep it from doing so. fmaf stands exactly where torch's own kernels fuse (add with alpha,
// lerp, addcmul), as in the Triton kernel (kernels/adam.py).
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels.cuh"

namespace fastops {
namespace cuda {
namespace {

using detail::Elem;

// Per-launch and per-tensor scalars, in registers for the whole chunk.
struct StepScalars {
  float scale;          // grad_scale
  float decay;          // 1 - lr * weight_decay
  float neg_step_size;  // -lr / bias_correction1
  float bc2_sqrt;       // sqrt(bias_correction2)
};

// 1 - beta**step as -expm1f(step * log(beta)), log(beta) from the host in fp64. fp32 1 - powf(beta, step)
// is 2e-5 relative off at beta = 0.999 (fp32(0.999) alone is 1.3e-5 off in 1 - beta) and 2e-4 at 0.9999;
// expm1f is within 1 ulp, so the product's rounding (about 1e-7) dominates.
__device__ __forceinline__ float one_minus_pow(float log_beta, float step) {
  return -expm1f(__fmul_rn(step, log_beta));
}

template <bool AMSGRAD>
__device__ __forceinline__ void adam_math(float& p, float g, float& m, float& v, float& vmax, const AdamArgs& a,
                                          const StepScalars& s) {
  if (a.has_grad_scale) g = __fdiv_rn(g, s.scale);
  if (a.maximize) g = -g;
  if (a.wd_mode == 1) {
    g = fmaf(p, a.weight_decay, g);
  } else if (a.wd_mode == 2) {
    p = __fmul_rn(p, s.decay);
  }
  const float diff = __fsub_rn(g, m);
  m = a.lerp_small ? fmaf(a.lerp_weight, diff, m) : fmaf(__fsub_rn(a.lerp_weight, 1.0f), diff, g);
  v = fmaf(__fmul_rn(a.one_minus_beta2, g), g, __fmul_rn(v, a.beta2));
  float vhat = v;
  if (AMSGRAD) {
    vmax = detail::max_nan(vmax, v);
    vhat = vmax;
  }
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vhat), s.bc2_sqrt), a.eps);
  p = __fadd_rn(p, __fdiv_rn(__fmul_rn(s.neg_step_size, m), denom));
}

template <typename T, bool AMSGRAD, bool MASTER>
__global__ void __launch_bounds__(kThreads) adam_kernel(const AdamArgs a) {
  // A skipped step touches nothing; the binding already left the step counters as they were.
  if (a.found_inf != nullptr && *a.found_inf != 0.0f) return;
  StepScalars s;
  const float lr = a.lr_ptr != nullptr ? *a.lr_ptr : a.lr;
  s.decay = a.lr_ptr != nullptr ? fmaf(-lr, a.weight_decay, 1.0f) : a.decay;
  s.scale = a.grad_scale_ptr != nullptr ? *a.grad_scale_ptr : a.grad_scale;

  for (int64_t c = blockIdx.x; c < a.n_chunks; c += gridDim.x) {
    const int64_t t = a.chunks[2 * c];
    const int64_t start = a.chunks[2 * c + 1] * kChunkSize;
    const int64_t* row = a.tensors + t * kAdamCols;
    T* p = reinterpret_cast<T*>(row[kAdamParam]);
    const T* g = reinterpret_cast<const T*>(row[kAdamGrad]);
    float* m = reinterpret_cast<float*>(row[kAdamExpAvg]);
    float* v = reinterpret_cast<float*>(row[kAdamExpAvgSq]);
    float* vmax = reinterpret_cast<float*>(row[kAdamMaxExpAvgSq]);
    float* w = reinterpret_cast<float*>(row[kAdamMaster]);
    const int64_t numel = row[kAdamNumel];
    const float step = *reinterpret_cast<const float*>(row[kAdamStep]);
    const int64_t end = numel < start + kChunkSize ? numel : start + kChunkSize;

    const float bc1 = one_minus_pow(a.log_beta1, step);
    const float bc2 = one_minus_pow(a.log_beta2, step);
    s.neg_step_size = -__fdiv_rn(lr, bc1);
    s.bc2_sqrt = __fsqrt_rn(bc2);

    // start is a multiple of 65536 elements, so the chunk is as aligned as the tensor's base pointer.
    const bool vec = detail::aligned(p, 4 * sizeof(T)) && detail::aligned(g, 4 * sizeof(T)) &&
                     detail::aligned(m, 16) && detail::aligned(v, 16) && (!AMSGRAD || detail::aligned(vmax, 16)) &&
                     (!MASTER || detail::aligned(w, 16));
    int64_t scalar_from = start;
    if (vec) {
      const int64_t vec_end = start + (end - start) / 4 * 4;
      for (int64_t i = start + 4 * static_cast<int64_t>(threadIdx.x); i < vec_end; i += 4 * static_cast<int64_t>(blockDim.x)) {
        float pf[4], gf[4], mf[4], vf[4], vmf[4];
        if (MASTER) {
          detail::load4<false>(w + i, pf);
        } else {
          detail::load4<false>(p + i, pf);
        }
        detail::load4<true>(g + i, gf);
        detail::load4<false>(m + i, mf);
        detail::load4<false>(v + i, vf);
        if (AMSGRAD) detail::load4<false>(vmax + i, vmf);
#pragma unroll
        for (int k = 0; k < 4; ++k) adam_math<AMSGRAD>(pf[k], gf[k], mf[k], vf[k], vmf[k], a, s);
        detail::store4(m + i, mf);
        detail::store4(v + i, vf);
        if (AMSGRAD) detail::store4(vmax + i, vmf);
        if (MASTER) detail::store4(w + i, pf);
        detail::store4(p + i, pf);
      }
      scalar_from = vec_end;
    }
    // The unaligned case, and the last numel % 4 elements of an aligned tensor.
    for (int64_t i = scalar_from + threadIdx.x; i < end; i += blockDim.x) {
      float pf = MASTER ? w[i] : Elem<T>::load(p[i]);
      float mf = m[i], vf = v[i];
      float vmf = AMSGRAD ? vmax[i] : 0.0f;
      adam_math<AMSGRAD>(pf, detail::load_ro(g + i), mf, vf, vmf, a, s);
      m[i] = mf;
      v[i] = vf;
      if (AMSGRAD) vmax[i] = vmf;
      if (MASTER) w[i] = pf;
      p[i] = Elem<T>::store(pf);
    }
  }
}

template <typename T>
void launch(const AdamArgs& a, int max_blocks, cudaStream_t stream) {
  auto kernel = a.amsgrad ? (a.has_master ? adam_kernel<T, true, true> : adam_kernel<T, true, false>)
                          : (a.has_master ? adam_kernel<T, false, true> : adam_kernel<T, false, false>);
  detail::launch_resident(kernel, a, max_blocks, stream);
}

}  // namespace

cudaError_t adam_step(ScalarKind kind, const AdamArgs& args, int max_blocks, cudaStream_t stream) {
  if (args.n_chunks == 0) return cudaSuccess;
  return detail::launch_for_kind(kind,
                                 [&](auto t) { launch<typename decltype(t)::type>(args, max_blocks, stream); });
}

}  // namespace cuda
}  // namespace fastops
