// fastops.adam_step_ on CUDA: one launch per param dtype over a chunk table (kernels.cuh), the update of
// adam_math.cuh on fp32 states.
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "adam_math.cuh"
#include "kernels.cuh"

namespace fastops {
namespace cuda {
namespace {

using detail::Elem;

template <typename T, bool AMSGRAD, bool MASTER>
__global__ void __launch_bounds__(kThreads) adam_kernel(const AdamArgs a) {
  // A skipped step touches nothing; the binding already left the step counters as they were.
  if (a.found_inf != nullptr && *a.found_inf != 0.0f) return;
  detail::StepScalars s;
  const float lr = detail::launch_scalars(a, s);

  for (int64_t c = blockIdx.x; c < a.n_chunks; c += gridDim.x) {
    const detail::Chunk ch = detail::chunk_at<kAdamCols>(a, c, lr, s);
    const int64_t* row = ch.row;
    const int64_t start = ch.start, end = ch.end;
    T* p = reinterpret_cast<T*>(row[kAdamParam]);
    const T* g = reinterpret_cast<const T*>(row[kAdamGrad]);
    float* m = reinterpret_cast<float*>(row[kAdamExpAvg]);
    float* v = reinterpret_cast<float*>(row[kAdamExpAvgSq]);
    float* vmax = reinterpret_cast<float*>(row[kAdamMaxExpAvgSq]);
    float* w = reinterpret_cast<float*>(row[kAdamMaster]);

    // start is a multiple of 65536 elements, so the chunk is as aligned as the tensor's base pointer.
    const bool vec = detail::aligned(p, 4 * sizeof(T)) && detail::aligned(g, 4 * sizeof(T)) &&
                     detail::aligned(m, 16) && detail::aligned(v, 16) && (!AMSGRAD || detail::aligned(vmax, 16)) &&
                     (!MASTER || detail::aligned(w, 16));
    int64_t scalar_from = start;
    if (vec) {
      const int64_t vec_end = start + (end - start) / 4 * 4;
      for (int64_t i = start + 4 * static_cast<int64_t>(threadIdx.x); i < vec_end;
           i += 4 * static_cast<int64_t>(blockDim.x)) {
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
        for (int k = 0; k < 4; ++k) detail::adam_math<AMSGRAD>(pf[k], gf[k], mf[k], vf[k], vmf[k], a, s);
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
      detail::adam_math<AMSGRAD>(pf, detail::load_ro(g + i), mf, vf, vmf, a, s);
      m[i] = mf;
      v[i] = vf;
      if (AMSGRAD) vmax[i] = vmf;
      if (MASTER) w[i] = pf;
      p[i] = Elem<T>::store(pf);
    }
  }
}

}  // namespace

cudaError_t adam_step(ScalarKind kind, const AdamArgs& a, int max_blocks, cudaStream_t stream) {
  return detail::launch_adam(kind, a, a.amsgrad, a.has_master, max_blocks, stream, [](auto t, auto ams, auto master) {
    return adam_kernel<typename decltype(t)::type, decltype(ams)::value, decltype(master)::value>;
  });
}

}  // namespace cuda
}  // namespace fastops
