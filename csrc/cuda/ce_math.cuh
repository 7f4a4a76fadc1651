// linear_cross_entropy's per-row math, __host__ __device__: the CUDA row pass (linear_ce.cu) runs it in a block of
// kCeThreads threads a row, and csrc/cpu/ce_cuda_host.cpp compiles it for the host and runs the same steps in the
// same order on one thread (the threads' partial sums, the tree that merges them, the gradient loop), so the CPU
// tests execute the CUDA kernel's arithmetic against the reference. No torch and no CUDA library header.
//
// Every rounding is written out: the multiplies and adds go through ce_mul/ce_add (__fmul_rn/__fadd_rn on the
// device, which nvcc never contracts into an FMA; plain operators on the host, built with -ffp-contract=off), the
// FMAs through fmaf, the exp is a polynomial of those (not the libraries' expf, which differ between host and
// device), the bf16 and fp16 conversions are round-to-nearest-even on bits. Only logf is the library's on each
// side (both within 1 ulp).
#pragma once

#include "host_device.h"

#define FASTOPS_HD FASTOPS_HOST_DEVICE

namespace fastops {
namespace ce {

// Threads a row: 8 warps stream a row of tens of thousands of logits; a power of 2 (the merge tree halves it).
constexpr int kCeThreads = 256;

// 16-bit storage types: the same bits on both sides, converted by the functions below.
struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

// The roundings, through host_device.h's intrinsics (CUDA's own on the device, the IEEE operation on the host).
namespace hd = fastops::cuda::detail;
FASTOPS_HD uint32_t as_bits(float f) { return hd::__float_as_uint(f); }
FASTOPS_HD float as_float(uint32_t u) { return hd::__uint_as_float(u); }
FASTOPS_HD float ce_mul(float a, float b) { return hd::__fmul_rn(a, b); }
FASTOPS_HD float ce_add(float a, float b) { return hd::__fadd_rn(a, b); }
FASTOPS_HD float ce_sub(float a, float b) { return ce_add(a, -b); }
FASTOPS_HD float ce_fma(float a, float b, float c) { return hd::__fmaf_rn(a, b, c); }
FASTOPS_HD float ce_div(float a, float b) { return hd::__fdiv_rn(a, b); }

FASTOPS_HD float ce_log(float x) {
#ifdef __CUDA_ARCH__
  return logf(x);
#else
  return std::log(x);
#endif
}

// exp(x) within 2 ulp of expf over [-87, 88] (Cephes' expf, as csrc/cpu/ce_isa.h): x = n ln2 + r, a degree-6
// polynomial for exp(r), n added to the exponent. Below -87 it returns exp(-87), far below the rounding of a row's
// sum, which holds exp(0) = 1.
FASTOPS_HD float ce_exp(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  const float t = ce_fma(x, 1.44269504088896341f, 12582912.0f);  // 1.5 * 2^23: n = round(x / ln2) in t's low bits
  const float n = ce_sub(t, 12582912.0f);
  float r = ce_fma(n, -0.693359375f, x);
  r = ce_fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = ce_fma(p, r, 1.3981999507e-3f);
  p = ce_fma(p, r, 8.3334519073e-3f);
  p = ce_fma(p, r, 4.1665795894e-2f);
  p = ce_fma(p, r, 1.6666665459e-1f);
  p = ce_fma(p, r, 5.0000001201e-1f);
  const float y = ce_add(ce_fma(ce_mul(p, r), r, r), 1.0f);
  return as_float(as_bits(y) + ((as_bits(t) - 0x4B400000u) << 23));
}

FASTOPS_HD float load(const float* p, int64_t j) { return p[j]; }
FASTOPS_HD float load(const Bf16* p, int64_t j) { return as_float(uint32_t(p[j].bits) << 16); }
FASTOPS_HD float load(const F16* p, int64_t j) {
  const uint32_t h = p[j].bits, sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
  if (e == 0x1Fu) return as_float(sign | 0x7F800000u | (mant << 13));  // inf, nan
  if (e != 0) return as_float(sign | ((e + 112u) << 23) | (mant << 13));
  const float f = ce_mul(float(mant), 5.9604644775390625e-8f);  // subnormal: mant * 2^-24, exact in fp32
  return sign ? -f : f;
}

FASTOPS_HD void store(float* p, int64_t j, float f) { p[j] = f; }
FASTOPS_HD void store(Bf16* p, int64_t j, float f) {
  const uint32_t u = as_bits(f);
  p[j].bits = (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t((u >> 16) | 0x40u)  // nan stays nan
                                               : uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
FASTOPS_HD void store(F16* p, int64_t j, float f) {
  const uint32_t u = as_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
  uint32_t h;
  if (a > 0x7F800000u) {
    h = 0x7E00u;  // nan
  } else if (a >= 0x477FF000u) {
    h = 0x7C00u;  // rounds to inf (65520 and above)
  } else if (a >= 0x38800000u) {  // normal in fp16: drop 13 bits, to nearest even
    const uint32_t r = a - 0x38000000u;
    h = (r + 0xFFFu + ((r >> 13) & 1u)) >> 13;
  } else {  // subnormal or zero in fp16: |f| / 2^-24, to nearest even (exact in fp32 below 2^-14 * 2^24)
    const float q = ce_mul(as_float(a), 16777216.0f);
    const float fl = float(uint32_t(q));
    const float diff = ce_sub(q, fl);
    uint32_t m = uint32_t(q);
    if (diff > 0.5f || (diff == 0.5f && (m & 1u))) ++m;
    h = m;
  }
  p[j].bits = uint16_t(sign | h);
}

// A thread's running state over its logits: the max, the sum of exp(z - max), the sum of z (label smoothing).
struct Stats {
  float m;
  float s;
  float zsum;
};

FASTOPS_HD Stats stats_empty() { return {-__builtin_inff(), 0.0f, 0.0f}; }

// One logit: the online softmax (one exp per logit, and one more when the max moves).
FASTOPS_HD void stats_add(Stats& a, float z) {
  a.zsum = ce_add(a.zsum, z);
  if (z > a.m) {
    a.s = ce_add(ce_mul(a.s, ce_exp(ce_sub(a.m, z))), 1.0f);
    a.m = z;
  } else if (a.m != -__builtin_inff()) {  // a -inf logit (a banned class's bias) before any finite one adds 0
    a.s = ce_add(a.s, ce_exp(ce_sub(z, a.m)));
  }
}

FASTOPS_HD Stats stats_merge(Stats a, Stats b) {
  const float zsum = ce_add(a.zsum, b.zsum);
  if (b.s == 0.0f) return {a.m, a.s, zsum};  // b saw no logit (a thread past the row's end)
  if (a.s == 0.0f) return {b.m, b.s, zsum};
  if (a.m >= b.m) return {a.m, ce_add(a.s, ce_mul(b.s, ce_exp(ce_sub(b.m, a.m)))), zsum};
  return {b.m, ce_add(b.s, ce_mul(a.s, ce_exp(ce_sub(a.m, b.m)))), zsum};
}

// Thread `tid` of `threads`: its logits j = tid, tid + threads, ... (a block's loads coalesce).
template <typename T>
FASTOPS_HD Stats stats_part(const T* z, int64_t v, int tid, int threads) {
  Stats st = stats_empty();
  for (int64_t j = tid; j < v; j += threads) stats_add(st, load(z, j));
  return st;
}

// One level of the merge tree: partial tid takes in partial tid + stride (stride = threads/2, threads/4, ..., 1).
FASTOPS_HD void merge_step(Stats* parts, int tid, int stride) {
  parts[tid] = stats_merge(parts[tid], parts[tid + stride]);
}

FASTOPS_HD float row_lse(const Stats& st) { return ce_add(st.m, ce_log(st.s)); }

// In log-probabilities, as torch: (1 - eps)(lse - z_t) + eps (lse - mean z), exactly 0 at V = 1.
FASTOPS_HD float row_loss(float lse, float zt, float zsum, int64_t v, float eps) {
  float l = ce_mul(ce_sub(1.0f, eps), ce_sub(lse, zt));
  if (eps != 0.0f) l = ce_add(l, ce_mul(eps, ce_sub(lse, ce_div(zsum, float(v)))));
  return l;
}

// Thread `tid`'s logits overwritten by c * d(loss)/dz: c (softmax - eps/V - (1 - eps) [j == t]).
template <typename T>
FASTOPS_HD void grad_part(T* z, int64_t v, int64_t t, float lse, float c, float eps, int tid, int threads) {
  const float off = ce_div(eps, float(v)), hit = ce_sub(1.0f, eps);
  for (int64_t j = tid; j < v; j += threads) {
    float d = ce_sub(ce_exp(ce_sub(load(z, j), lse)), off);
    if (j == t) d = ce_sub(d, hit);
    store(z, j, ce_mul(c, d));
  }
}

}  // namespace ce
}  // namespace fastops

#undef FASTOPS_HD
