// The Adam/AdamW update every CUDA Adam kernel runs (adam.cu on fp32 states, adam_lowp.cu on 8-bit or bf16 states
// decoded to fp32 before it and encoded after), and the scalars of each chunk's step.
//
// The math per element is fastops/reference.py's in fp32, in the same order, with the roundings spelled out
// (__f*_rn, __d*_rn): nvcc contracts a * b + c into an FMA wherever it likes (-fmad=true is its default), and the
// intrinsics keep it from doing so. fmaf stands exactly where torch's own kernels fuse (add with alpha, lerp,
// addcmul), as in the Triton kernels (kernels/_adam.py).
//
// FASTOPS_HOST_DEVICE (__host__ __device__): the CPU build compiles this file for the host too (host_device.h),
// and the CPU tests run it.
#pragma once

#include <cstdint>

#include "args.h"
#include "host_device.h"

namespace fastops {
namespace cuda {
namespace detail {

// Per-launch and per-tensor scalars, in registers for the whole chunk.
struct StepScalars {
  float scale;          // grad_scale
  float decay;          // 1 - lr * weight_decay
  float neg_step_size;  // -lr / bias_correction1
  float bc2_sqrt;       // sqrt(bias_correction2)
};

// beta ** step in fp64 for an integral step, by squaring. fp64 exp() here kept its values on the stack (8-16 bytes
// of spills on sm_90); the squarings do not. A 32-bit count: with a 64-bit one the amsgrad kernels took 42 registers
// on sm_80/sm_90 (2 blocks an SM) instead of 40 (3). An fp32 counter stops counting at 2**24 anyway; the clamp at
// 2**32 - 256 changes nothing for beta <= 1 - 1e-7, where beta ** step is below 1e-186 either way (1 - it is 1.0).
FASTOPS_HOST_DEVICE double pow_int(double beta, float step) {
  double r = 1.0;
#pragma unroll 1
  for (uint32_t n = static_cast<uint32_t>(fminf(step, 4294967040.0f)); n != 0; n >>= 1) {
    if (n & 1) r = __dmul_rn(r, beta);
    beta = __dmul_rn(beta, beta);
  }
  return r;
}

// lr, with the launch's grad_scale and decay into s. The decay and the bias corrections are computed in fp64 and
// rounded once to fp32, as the reference's Python floats reach torch's fp32 kernels. Measured against the
// reference's scalars over steps 1..10000 (betas (0.9, 0.999), (0.95, 0.9999), (0.9, 0.95), (0.5, 0.99)): fp64
// differs in none; fp32 -expm1f(step * log(beta)) gives another -lr / bc1 in 0-80 steps and another sqrt(bc2) in
// 73-2042. Over 10k sampled steps up to 1.6e7 the fp64 squarings still differ in none. With lr read in the kernel,
// 1 - lr * weight_decay from an fp32 weight_decay differs in 7 of 10k lrs at weight_decay 0.1 and 29 at 0.3, from
// the fp64 one in none.
FASTOPS_HOST_DEVICE float launch_scalars(const AdamCommonArgs& a, StepScalars& s) {
  const float lr = a.lr_ptr != nullptr ? *a.lr_ptr : a.lr;
  s.decay = a.lr_ptr != nullptr ? static_cast<float>(__dadd_rn(1.0, -__dmul_rn(lr, a.weight_decay64))) : a.decay;
  s.scale = a.grad_scale_ptr != nullptr ? *a.grad_scale_ptr : a.grad_scale;
  return lr;
}

// The bias corrections of a tensor at `step` into s.
FASTOPS_HOST_DEVICE void bias_corrections(const AdamCommonArgs& a, float lr, float step, StepScalars& s) {
  const double bc1 = 1.0 - pow_int(a.beta1_64, step);
  const double bc2 = 1.0 - pow_int(a.beta2_64, step);
  s.neg_step_size = static_cast<float>(-(static_cast<double>(lr) / bc1));
  s.bc2_sqrt = static_cast<float>(sqrt(bc2));
}

// Chunk c of the chunk table: its tensor's table row and element range [start, end); the tensor's bias
// corrections into s. kNumelCol: the table's last column.
struct Chunk {
  const int64_t* row;
  int64_t start;
  int64_t end;
};

template <int kCols>
FASTOPS_HOST_DEVICE Chunk chunk_at(const AdamCommonArgs& a, int64_t c, float lr, StepScalars& s) {
  Chunk k;
  k.row = a.tensors + a.chunks[2 * c] * kCols;
  k.start = a.chunks[2 * c + 1] * kChunkSize;
  const int64_t numel = k.row[kCols - 1];
  k.end = numel < k.start + kChunkSize ? numel : k.start + kChunkSize;
  bias_corrections(a, lr, *reinterpret_cast<const float*>(k.row[kAdamStep]), s);
  return k;
}

// One element's step. vmax is read and written only with AMSGRAD. INV_BC2: bf16 states' denominator (reference.py's
// inv_bc2).
template <bool AMSGRAD, bool INV_BC2 = false>
FASTOPS_HOST_DEVICE void adam_math(float& p, float g, float& m, float& v, float& vmax, const AdamCommonArgs& a,
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
    vmax = max_nan(vmax, v);
    vhat = vmax;
  }
  const float root = __fsqrt_rn(vhat);
  const float denom =
      __fadd_rn(INV_BC2 ? __fmul_rn(root, __fdiv_rn(1.0f, s.bc2_sqrt)) : __fdiv_rn(root, s.bc2_sqrt), a.eps);
  p = __fadd_rn(p, __fdiv_rn(__fmul_rn(s.neg_step_size, m), denom));
}

}  // namespace detail

}  // namespace cuda
}  // namespace fastops
