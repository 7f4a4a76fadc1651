// fastops.adam_step_lowp_ on CUDA: adam_math.cuh's update on states stored as 8-bit blockwise codes or bf16 with
// stochastic rounding (codec.cuh), decoded to fp32 before it and encoded after.
//
// One warp owns one 256-element quantization block at a time (8 elements a lane, lane l taking l, l + 32, ...:
// coalesced), so a block's absmax is a warp reduction (shuffles, no shared memory, no barrier).
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "adam_math.cuh"
#include "codec.cuh"
#include "kernels.cuh"

namespace fastops {
namespace cuda {
namespace {

using detail::Elem;

constexpr int kQBlock = 256;
constexpr int kPerLane = kQBlock / 32;

// (kThreads, 1): with the default bound ptxas held some specializations to 40-64 registers and spilled 8-16 bytes
// on sm_90; with it they take 54-83 and none spills (nvcc 13.0 -Xptxas -v), 3 blocks an SM at 83.
template <typename T, bool EIGHT_BIT, bool MASTER>
__global__ void __launch_bounds__(kThreads, 1) adam_lowp_kernel(const AdamLowpArgs a) {
  if (a.found_inf != nullptr && *a.found_inf != 0.0f) return;
  detail::StepScalars s;
  const float lr = detail::launch_scalars(a, s);
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  constexpr int kWarps = kThreads / 32;

  for (int64_t c = blockIdx.x; c < a.n_chunks; c += gridDim.x) {
    const detail::Chunk ch = detail::chunk_at<kLowpCols>(a, c, lr, s);
    const int64_t* row = ch.row;
    T* p = reinterpret_cast<T*>(row[kAdamParam]);
    const T* g = reinterpret_cast<const T*>(row[kAdamGrad]);
    float* w = reinterpret_cast<float*>(row[kAdamMaster]);
    float* m_absmax = reinterpret_cast<float*>(row[kLowpExpAvgAbsmax]);
    float* v_absmax = reinterpret_cast<float*>(row[kLowpExpAvgSqAbsmax]);
    const uint32_t key = detail::sr_key(a.seed, row[kLowpIndex]);

    // kChunkSize is a multiple of 256: every quantization block lies in one chunk.
    for (int64_t b0 = ch.start + static_cast<int64_t>(warp) * kQBlock; b0 < ch.end; b0 += kWarps * kQBlock) {
      float pf[kPerLane], mf[kPerLane], vf[kPerLane];
      float m_scale = 0.0f, v_scale = 0.0f;
      const uint32_t kb = EIGHT_BIT ? 0u : detail::sr_block_key(key, b0 / kQBlock);
      if (EIGHT_BIT) {
        m_scale = m_absmax[b0 / kQBlock];
        v_scale = v_absmax[b0 / kQBlock];
      }
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        const int64_t i = b0 + lane + 32 * k;
        pf[k] = mf[k] = vf[k] = 0.0f;
        if (i < ch.end) {
          pf[k] = MASTER ? w[i] : Elem<T>::load(p[i]);
          float gf = detail::load_ro(g + i);
          if (EIGHT_BIT) {
            mf[k] = detail::decode<true>(reinterpret_cast<const uint8_t*>(row[kAdamExpAvg])[i], m_scale);
            vf[k] = detail::decode<false>(reinterpret_cast<const uint8_t*>(row[kAdamExpAvgSq])[i], v_scale);
          } else {
            mf[k] = __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(row[kAdamExpAvg])[i]);
            vf[k] = __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(row[kAdamExpAvgSq])[i]);
          }
          float unused = 0.0f;
          detail::adam_math<false, !EIGHT_BIT>(pf[k], gf, mf[k], vf[k], unused, a, s);
          if (MASTER) w[i] = pf[k];
          p[i] = Elem<T>::store(pf[k]);
          if (!EIGHT_BIT) {
            const uint32_t bits = detail::sr_bits(kb, lane + 32 * k);
            reinterpret_cast<unsigned short*>(row[kAdamExpAvg])[i] = detail::round_bf16_sr(mf[k], bits & 0xFFFFu);
            reinterpret_cast<unsigned short*>(row[kAdamExpAvgSq])[i] = detail::round_bf16_sr(vf[k], bits >> 16);
          }
        }
      }
      if (EIGHT_BIT) {
        // Lanes past the end hold 0, which never raises a max of |m| or of v >= 0.
        float mmax = 0.0f, vmax = 0.0f;
#pragma unroll
        for (int k = 0; k < kPerLane; ++k) {
          mmax = detail::max_nan(mmax, fabsf(mf[k]));
          vmax = detail::max_nan(vmax, vf[k]);
        }
        mmax = detail::warp_max_nan(mmax);
        vmax = detail::warp_max_nan(vmax);
        if (lane == 0) {
          m_absmax[b0 / kQBlock] = mmax;
          v_absmax[b0 / kQBlock] = vmax;
        }
#pragma unroll
        for (int k = 0; k < kPerLane; ++k) {
          const int64_t i = b0 + lane + 32 * k;
          if (i < ch.end) {
            reinterpret_cast<uint8_t*>(row[kAdamExpAvg])[i] = detail::encode<true>(__fdiv_rn(mf[k], mmax));
            reinterpret_cast<uint8_t*>(row[kAdamExpAvgSq])[i] = detail::encode<false>(__fdiv_rn(vf[k], vmax));
          }
        }
      }
    }
  }
}

}  // namespace

cudaError_t adam_step_lowp(ScalarKind kind, const AdamLowpArgs& a, int max_blocks, cudaStream_t stream) {
  const bool eight_bit = a.format == StateFormat::kEightBit;
  return detail::launch_adam(kind, a, eight_bit, a.has_master, max_blocks, stream, [](auto t, auto eight, auto master) {
    return adam_lowp_kernel<typename decltype(t)::type, decltype(eight)::value, decltype(master)::value>;
  });
}

}  // namespace cuda
}  // namespace fastops
