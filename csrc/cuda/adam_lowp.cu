// fastops.adam_step_lowp_ on CUDA: adam.cu's update on states stored as 8-bit blockwise codes or bf16 with
// stochastic rounding, the formats fastops/_quant.py defines bit for bit.
//
// One warp owns one 256-element quantization block at a time (8 elements a lane, lane l taking l, l + 32, ...:
// coalesced), so a block's absmax is a warp reduction (shuffles, no shared memory, no barrier). The bias
// corrections are computed in fp64 and rounded once, as the reference's Python floats reach torch's fp32 kernels.
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels.cuh"
#include "qmaps.cuh"

namespace fastops {
namespace cuda {
namespace {

using detail::Elem;

constexpr int kQBlock = 256;
constexpr int kPerLane = kQBlock / 32;

struct Scalars {
  float scale, decay, neg_step_size, bc2_sqrt;
};

__device__ __forceinline__ void adam_math(float& p, float g, float& m, float& v, const AdamLowpArgs& a,
                                          const Scalars& s) {
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
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), s.bc2_sqrt), a.eps);
  p = __fadd_rn(p, __fdiv_rn(__fmul_rn(s.neg_step_size, m), denom));
}

// _quant.encode: decade by threshold, fraction by ((a * P) - 0.1) * F - 0.5 rounded half-even, no FMA.
template <bool SIGNED>
__device__ __forceinline__ uint8_t encode(float x) {
  const float* T = SIGNED ? kSignedT : kUnsignedT;
  const float* P = SIGNED ? kSignedP : kUnsignedP;
  const float* F = SIGNED ? kSignedF : kUnsignedF;
  const float a = SIGNED ? fabsf(x) : x;
  int i = 0;
#pragma unroll
  for (int k = 1; k < 7; ++k) i += a >= T[k];
  const int n = SIGNED ? (1 << i) : (2 << i);
  const float t = __fsub_rn(__fmul_rn(__fsub_rn(__fmul_rn(a, P[i]), 0.1f), F[i]), 0.5f);
  int j = static_cast<int>(rintf(t));  // round half to even
  j = j < 0 ? 0 : (j > n - 1 ? n - 1 : j);
  int code = n + j;
  int top = 1;
  if (SIGNED) {
    const bool neg = x < 0.0f;
    code = neg ? (code | 0x80) : code;
    top = neg ? 0xFF : 0x80;
  }
  if (a >= T[7]) code = top;
  if (!(a >= T[0])) code = 0;
  return static_cast<uint8_t>(code);
}

__device__ __forceinline__ uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

__device__ __forceinline__ unsigned short round_bf16_sr(float x, uint32_t r16) {
  const uint32_t bits = __float_as_uint(x);
  if (x != x) return 0x7FC0;
  return static_cast<unsigned short>((detail::finite(x) ? bits + r16 : bits) >> 16);
}

// 1 - beta**step in fp64 for an integral step, by squaring (about 1e-15 relative at step 1e6, far below the
// fp32 rounding that follows). fp64 exp() here kept its values on the stack (8-16 bytes of spills on sm_90).
__device__ __forceinline__ double one_minus_pow64(double beta, float step) {
  double r = 1.0;
  for (uint64_t n = static_cast<uint64_t>(step); n != 0; n >>= 1) {
    if (n & 1) r = __dmul_rn(r, beta);
    beta = __dmul_rn(beta, beta);
  }
  return 1.0 - r;
}

// Row max across the warp, nan if any lane holds a nan (torch.amax).
__device__ __forceinline__ float warp_max_nan(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = detail::max_nan(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// (kThreads, 1): with the default bound ptxas held some specializations to 40-64 registers and spilled 8-16 bytes
// on sm_90; with it they take 54-83 and none spills (nvcc 13.0 -Xptxas -v), 3 blocks an SM at 83.
template <typename T, bool EIGHT_BIT, bool MASTER>
__global__ void __launch_bounds__(kThreads, 1) adam_lowp_kernel(const AdamLowpArgs a) {
  if (a.found_inf != nullptr && *a.found_inf != 0.0f) return;
  Scalars s;
  const float lr = a.lr_ptr != nullptr ? *a.lr_ptr : a.lr;
  s.decay = a.lr_ptr != nullptr ? static_cast<float>(1.0 - static_cast<double>(lr) * a.weight_decay64) : a.decay;
  s.scale = a.grad_scale_ptr != nullptr ? *a.grad_scale_ptr : a.grad_scale;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  constexpr int kWarps = kThreads / 32;

  for (int64_t c = blockIdx.x; c < a.n_chunks; c += gridDim.x) {
    const int64_t t = a.chunks[2 * c];
    const int64_t start = a.chunks[2 * c + 1] * kChunkSize;
    const int64_t* row = a.tensors + t * kLowpCols;
    T* p = reinterpret_cast<T*>(row[kLowpParam]);
    const T* g = reinterpret_cast<const T*>(row[kLowpGrad]);
    float* w = reinterpret_cast<float*>(row[kLowpMaster]);
    float* m_absmax = reinterpret_cast<float*>(row[kLowpExpAvgAbsmax]);
    float* v_absmax = reinterpret_cast<float*>(row[kLowpExpAvgSqAbsmax]);
    const int64_t numel = row[kLowpNumel];
    const float step = *reinterpret_cast<const float*>(row[kLowpStep]);
    const int64_t end = numel < start + kChunkSize ? numel : start + kChunkSize;
    const double bc1 = one_minus_pow64(a.beta1_64, step);
    const double bc2 = one_minus_pow64(a.beta2_64, step);
    s.neg_step_size = static_cast<float>(-(static_cast<double>(lr) / bc1));
    s.bc2_sqrt = static_cast<float>(sqrt(bc2));
    const uint32_t key = mix32(a.seed ^ mix32(static_cast<uint32_t>(row[kLowpIndex]) + 0x9E3779B9u));

    // kChunkSize is a multiple of 256: every quantization block lies in one chunk.
    for (int64_t b0 = start + static_cast<int64_t>(warp) * kQBlock; b0 < end; b0 += kWarps * kQBlock) {
      float pf[kPerLane], mf[kPerLane], vf[kPerLane];
      float m_scale = 0.0f, v_scale = 0.0f;
      if (EIGHT_BIT) {
        m_scale = m_absmax[b0 / kQBlock];
        v_scale = v_absmax[b0 / kQBlock];
      }
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        const int64_t i = b0 + lane + 32 * k;
        pf[k] = mf[k] = vf[k] = 0.0f;
        if (i < end) {
          pf[k] = MASTER ? w[i] : Elem<T>::load(p[i]);
          float gf = detail::load_ro(g + i);
          if (EIGHT_BIT) {
            mf[k] = __fmul_rn(kSignedQmap[reinterpret_cast<const uint8_t*>(row[kLowpExpAvg])[i]], m_scale);
            vf[k] = __fmul_rn(kUnsignedQmap[reinterpret_cast<const uint8_t*>(row[kLowpExpAvgSq])[i]], v_scale);
          } else {
            mf[k] = __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(row[kLowpExpAvg])[i]);
            vf[k] = __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(row[kLowpExpAvgSq])[i]);
          }
          adam_math(pf[k], gf, mf[k], vf[k], a, s);
          if (MASTER) w[i] = pf[k];
          p[i] = Elem<T>::store(pf[k]);
          if (!EIGHT_BIT) {
            const uint32_t bits = mix32(static_cast<uint32_t>(i) ^ key ^
                                        (static_cast<uint32_t>(static_cast<uint64_t>(i) >> 32) * 0x85EBCA6Bu));
            reinterpret_cast<unsigned short*>(row[kLowpExpAvg])[i] = round_bf16_sr(mf[k], bits & 0xFFFFu);
            reinterpret_cast<unsigned short*>(row[kLowpExpAvgSq])[i] = round_bf16_sr(vf[k], bits >> 16);
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
        mmax = warp_max_nan(mmax);
        vmax = warp_max_nan(vmax);
        if (lane == 0) {
          m_absmax[b0 / kQBlock] = mmax;
          v_absmax[b0 / kQBlock] = vmax;
        }
#pragma unroll
        for (int k = 0; k < kPerLane; ++k) {
          const int64_t i = b0 + lane + 32 * k;
          if (i < end) {
            reinterpret_cast<uint8_t*>(row[kLowpExpAvg])[i] = encode<true>(__fdiv_rn(mf[k], mmax));
            reinterpret_cast<uint8_t*>(row[kLowpExpAvgSq])[i] = encode<false>(__fdiv_rn(vf[k], vmax));
          }
        }
      }
    }
  }
}

template <typename T>
void launch(const AdamLowpArgs& a, int max_blocks, cudaStream_t stream) {
  auto kernel = a.eight_bit ? (a.has_master ? adam_lowp_kernel<T, true, true> : adam_lowp_kernel<T, true, false>)
                            : (a.has_master ? adam_lowp_kernel<T, false, true> : adam_lowp_kernel<T, false, false>);
  detail::launch_resident(kernel, a, max_blocks, stream);
}

}  // namespace

cudaError_t adam_step_lowp(ScalarKind kind, const AdamLowpArgs& args, int max_blocks, cudaStream_t stream) {
  if (args.n_chunks == 0) return cudaSuccess;
  return detail::launch_for_kind(kind,
                                 [&](auto t) { launch<typename decltype(t)::type>(args, max_blocks, stream); });
}

}  // namespace cuda
}  // namespace fastops
