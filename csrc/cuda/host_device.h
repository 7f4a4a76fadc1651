// What lets the CUDA kernels' per-element math (adam_math.cuh, codec.cuh) compile for the host too, so that the CPU
// test suite runs it: csrc/cuda_math.cpp includes those headers with the C++ compiler of the CPU build (no CUDA
// toolkit needed) and tests/test_cuda_math.py holds what it computes to the reference and to the C++ CPU kernels.
//
// - Their functions are FASTOPS_HOST_DEVICE: `__host__ __device__ __forceinline__`. Under nvcc that is what it says;
//   under a host compiler this header defines the CUDA qualifiers away (and `__constant__` tables become inline
//   arrays: one definition in every translation unit that includes them).
// - The CUDA intrinsics they call (__fmul_rn, __fdiv_rn, __fsqrt_rn, __dmul_rn, __float_as_uint, ...) exist in
//   device code only. They are declared again below, in fastops::cuda::detail where that math lives, as
//   `__host__ __device__` functions: the device pass calls CUDA's own (the same PTX as before: mul.rn.f32, ...); the
//   host gets the IEEE operation it names, rounded to nearest even once (the CPU build compiles with
//   -ffp-contract=off, so a * b + c is never fused behind its back; fmaf is the C library's fused multiply-add).
// - warning 20091 (a __constant__ table read in a __host__ __device__ function) is silenced under nvcc: the codec's
//   tables are read only by its templates, which nvcc instantiates for the device alone (the CPU build reads the
//   host copies of the tables).
//
// To run other CUDA math on the host (as ce_math.cuh does for linear_ce's row math): put the per-element or per-row
// functions in a .cuh that includes this header, write them FASTOPS_HOST_DEVICE inside fastops::cuda::detail, add any
// intrinsic they call to the list below, include the .cuh from a function of csrc/cuda_math.cpp that loops over CPU
// tensors as the kernel loops over its threads, and compare its output in a test (tests/test_cuda_math.py).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#include <cuda_runtime.h>
#pragma nv_diag_suppress 20091
#else
#ifndef __host__
#define __host__
#endif
#ifndef __device__
#define __device__
#endif
#ifndef __constant__
#define __constant__ inline
#endif
#ifndef __forceinline__
#define __forceinline__ inline __attribute__((always_inline))
#endif
#endif

#define FASTOPS_HOST_DEVICE __host__ __device__ __forceinline__

namespace fastops {
namespace cuda {
namespace detail {

// FASTOPS_INTRINSIC(type, name, params, args, host): `name` as a __host__ __device__ function, CUDA's own on the
// device, `host` on the host.
#ifdef __CUDA_ARCH__
#define FASTOPS_INTRINSIC(type, name, params, args, host) \
  FASTOPS_HOST_DEVICE type name params { return ::name args; }
#else
#define FASTOPS_INTRINSIC(type, name, params, args, host) \
  FASTOPS_HOST_DEVICE type name params { return host; }
#endif
FASTOPS_INTRINSIC(float, __fadd_rn, (float a, float b), (a, b), a + b)
FASTOPS_INTRINSIC(float, __fsub_rn, (float a, float b), (a, b), a - b)
FASTOPS_INTRINSIC(float, __fmul_rn, (float a, float b), (a, b), a * b)
FASTOPS_INTRINSIC(float, __fdiv_rn, (float a, float b), (a, b), a / b)
FASTOPS_INTRINSIC(float, __fsqrt_rn, (float a), (a), std::sqrt(a))
FASTOPS_INTRINSIC(float, __fmaf_rn, (float a, float b, float c), (a, b, c), std::fma(a, b, c))
FASTOPS_INTRINSIC(double, __dadd_rn, (double a, double b), (a, b), a + b)
FASTOPS_INTRINSIC(double, __dmul_rn, (double a, double b), (a, b), a * b)
#undef FASTOPS_INTRINSIC

FASTOPS_HOST_DEVICE uint32_t __float_as_uint(float x) {
#ifdef __CUDA_ARCH__
  return ::__float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}

FASTOPS_HOST_DEVICE float __uint_as_float(uint32_t u) {
#ifdef __CUDA_ARCH__
  return ::__uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}


// torch.maximum: nan if either operand is nan (fmaxf would drop it).
FASTOPS_HOST_DEVICE float max_nan(float a, float b) { return (a != a || a > b) ? a : b; }

// |x| <= FLT_MAX is false exactly for inf and nan.
FASTOPS_HOST_DEVICE bool finite(float x) { return fabsf(x) <= 3.402823466e+38f; }

}  // namespace detail
}  // namespace cuda
}  // namespace fastops
