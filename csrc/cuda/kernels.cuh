// CUDA kernels of fastops: raw-pointer launchers (adam.cu, adam_lowp.cu, sgd.cu, amp.cu, dropout.cu) over the
// tables and arguments of args.h, and the device helpers they share. Only CUDA headers here, so `nvcc -c` builds the
// .cu files without torch.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "args.h"
#include "host_device.h"

namespace fastops {
namespace cuda {

// All launchers return cudaGetLastError() after the launch (cudaSuccess when there is nothing to do).
// max_blocks caps the grid; blocks grid-stride over the chunk table.
cudaError_t adam_step(ScalarKind kind, const AdamArgs& args, int max_blocks, cudaStream_t stream);

cudaError_t adam_step_lowp(ScalarKind kind, const AdamLowpArgs& args, int max_blocks, cudaStream_t stream);

cudaError_t sgd_step(ScalarKind kind, const SgdArgs& args, int max_blocks, cudaStream_t stream);

// grads[i] *= inv_scale, rounded once to the grad's dtype; *found_inf = 1.0f if any element was inf/nan.
cudaError_t unscale_check(ScalarKind kind, const int64_t* tensors, const int64_t* chunks, int64_t n_chunks,
                          float* found_inf, const float* inv_scale_ptr, float inv_scale, int max_blocks,
                          cudaStream_t stream);

// First pass of grad_stats: partials[3 * (first_partial + c) + {0, 1, 2}] = {sum of (g * inv_scale)^2,
// max |g * inv_scale| (nan if the chunk holds a nan), 1.0f if the chunk holds an inf/nan else 0.0f} for
// every chunk c. inv_scale is read through inv_scale_ptr when it is not null.
cudaError_t grad_stats_partials(ScalarKind kind, const int64_t* tensors, const int64_t* chunks, int64_t n_chunks,
                                float* partials, int64_t first_partial, const float* inv_scale_ptr, float inv_scale,
                                int max_blocks, cudaStream_t stream);

// Second pass: one block folds n_partials partials in a fixed order into out[3].
cudaError_t grad_stats_reduce(const float* partials, int64_t n_partials, float* out, cudaStream_t stream);

// out[k] = x[k] * dropout_factor(key, k, threshold, scale) for the n elements of x's memory (dropout_math.cuh).
cudaError_t dropout(ScalarKind kind, const void* x, void* out, int64_t n, uint32_t key, uint32_t threshold,
                    float scale, int max_blocks, cudaStream_t stream);

}  // namespace cuda
}  // namespace fastops

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

namespace fastops {
namespace cuda {
namespace detail {

template <typename T>
struct TypeTag {
  using type = T;
};

// Launches a grid-stride optimizer kernel with at most the blocks that are resident at once. max_blocks
// (binding.cpp) assumes 2048 / kThreads blocks an SM; a kernel whose registers leave room for fewer
// (adam_kernel: 35-62 registers by `python -m fastops compile-check`, 3 of 4 blocks an SM on sm_80/sm_90)
// would otherwise run its last blocks as a second wave behind the first.
template <typename Args>
void launch_resident(void (*kernel)(const Args), const Args& a, int max_blocks, cudaStream_t stream) {
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0) != cudaSuccess || per_sm < 1) {
    per_sm = 1;
  }
  const int64_t resident = static_cast<int64_t>(max_blocks) / (2048 / kThreads) * per_sm;
  const int blocks = static_cast<int>(a.n_chunks < resident ? a.n_chunks : resident);
  kernel<<<blocks, kThreads, 0, stream>>>(a);
}

// Calls launch(TypeTag<T>{}) with T the storage type of kind, then returns cudaGetLastError()
// (cudaErrorInvalidValue for a kind without one): the one place a launcher turns a ScalarKind into a type.
template <class Launch>
cudaError_t launch_for_kind(ScalarKind kind, const Launch& launch) {
  switch (kind) {
    case ScalarKind::kFloat32:
      launch(TypeTag<float>{});
      break;
    case ScalarKind::kBFloat16:
      launch(TypeTag<__nv_bfloat16>{});
      break;
    case ScalarKind::kFloat16:
      launch(TypeTag<__half>{});
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

// Conversions between storage types and fp32. _rn: round to nearest even, as torch's casts. The 16-bit
// types also convert from and to their bit patterns, which is how the 4-wide accesses move them.
template <typename T>
struct Elem;
template <>
struct Elem<float> {
  static __device__ __forceinline__ float load(float x) { return x; }
  static __device__ __forceinline__ float store(float x) { return x; }
};
// A 16-bit type's conversions from and to its bit pattern: its load and store of the same 16 bits.
template <typename T>
struct Bits16 {
  static __device__ __forceinline__ float from_bits(unsigned int b) {
    const unsigned short s = static_cast<unsigned short>(b);
    T x;
    memcpy(&x, &s, sizeof x);
    return Elem<T>::load(x);
  }
  static __device__ __forceinline__ unsigned int to_bits(float x) {
    const T t = Elem<T>::store(x);
    unsigned short s;
    memcpy(&s, &t, sizeof s);
    return s;
  }
};
template <>
struct Elem<__nv_bfloat16> : Bits16<__nv_bfloat16> {
  static __device__ __forceinline__ float load(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 store(float x) { return __float2bfloat16_rn(x); }
};
template <>
struct Elem<__half> : Bits16<__half> {
  static __device__ __forceinline__ float load(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half store(float x) { return __float2half_rn(x); }
};

// Pointers read from a table are generic addresses to nvcc, so plain accesses through them compile to
// generic LD.E/ST.E (LD.E.128 for the 4-wide ones) in the sm_90 SASS; neither __builtin_assume(__isGlobal(p))
// nor a cvta round trip changed that in the looped kernels. Read-only data (grads in adam and grad_stats)
// goes through __ldg, which is LDG.E.*.CONSTANT. Whether generic costs bandwidth here is unmeasured.

// Four consecutive elements at p, which must be aligned to 4 * sizeof(T): one 16-byte access for fp32,
// one 8-byte access for bf16/fp16. RO: p is not written during the kernel (the read-only path).
template <bool RO>
__device__ __forceinline__ void load4(const float* p, float (&out)[4]) {
  const float4* q = reinterpret_cast<const float4*>(p);
  const float4 v = RO ? __ldg(q) : *q;
  out[0] = v.x;
  out[1] = v.y;
  out[2] = v.z;
  out[3] = v.w;
}

__device__ __forceinline__ void store4(float* p, const float (&in)[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(in[0], in[1], in[2], in[3]);
}

template <bool RO, typename T>
__device__ __forceinline__ void load4(const T* p, float (&out)[4]) {
  static_assert(sizeof(T) == 2, "16-bit types only; fp32 has its own overload");
  // Little-endian: the element at the lower address is the low half of each 32-bit word.
  const uint2* q = reinterpret_cast<const uint2*>(p);
  const uint2 v = RO ? __ldg(q) : *q;
  out[0] = Elem<T>::from_bits(v.x & 0xffffu);
  out[1] = Elem<T>::from_bits(v.x >> 16);
  out[2] = Elem<T>::from_bits(v.y & 0xffffu);
  out[3] = Elem<T>::from_bits(v.y >> 16);
}

template <typename T>
__device__ __forceinline__ void store4(T* p, const float (&in)[4]) {
  static_assert(sizeof(T) == 2, "16-bit types only; fp32 has its own overload");
  uint2 v;
  v.x = Elem<T>::to_bits(in[0]) | (Elem<T>::to_bits(in[1]) << 16);
  v.y = Elem<T>::to_bits(in[2]) | (Elem<T>::to_bits(in[3]) << 16);
  *reinterpret_cast<uint2*>(p) = v;
}

// One element through the read-only path.
__device__ __forceinline__ float load_ro(const float* p) { return __ldg(p); }
template <typename T>
__device__ __forceinline__ float load_ro(const T* p) {
  static_assert(sizeof(T) == 2, "16-bit types only; fp32 has its own overload");
  return Elem<T>::from_bits(__ldg(reinterpret_cast<const unsigned short*>(p)));
}

__device__ __forceinline__ bool aligned(const void* p, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) % bytes) == 0;
}

// Max across the warp, nan if any lane holds a nan (torch.amax): a 256-element block's absmax.
__device__ __forceinline__ float warp_max_nan(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = max_nan(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Launches the kernel `pick(TypeTag<T>, x, y)` gives for kind's storage type T and the flags x and y (each as a
// std::bool_constant, for the kernel's template arguments); cudaSuccess when there is nothing to do. The Adam
// launchers (adam.cu, adam_lowp.cu).
template <class Args, class Pick>
cudaError_t launch_adam(ScalarKind kind, const Args& a, bool x, bool y, int max_blocks, cudaStream_t stream,
                        const Pick& pick) {
  if (a.n_chunks == 0) return cudaSuccess;
  return launch_for_kind(kind, [&](auto t) {
    const std::true_type on;
    const std::false_type off;
    auto kernel = x ? (y ? pick(t, on, on) : pick(t, on, off)) : (y ? pick(t, off, on) : pick(t, off, off));
    launch_resident(kernel, a, max_blocks, stream);
  });
}

}  // namespace detail
}  // namespace cuda
}  // namespace fastops
#endif  // __CUDACC__
