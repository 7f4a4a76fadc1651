// CUDA kernels of fastops: raw-pointer launchers (adam.cu, adam_lowp.cu, sgd.cu, amp.cu) and the table layout the binding
// (binding.cpp) fills. Only CUDA headers here, so `nvcc -c` builds the .cu files without torch.
//
// Every launcher walks a chunk table, as apex's multi_tensor_apply does: entry c is (tensor index, chunk
// index), the chunk covering elements [chunk * kChunkSize, min(numel, (chunk + 1) * kChunkSize)) of that
// tensor, and each tensor's pointers and numel sit in a row of a per-tensor table. Both tables are int64
// arrays in device memory, so one launch covers any number of tensors, and the binding caches them.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace fastops {
namespace cuda {

enum class ScalarKind : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// 65536 elements a chunk, as apex: a 1B-param model is 15k chunks (a 240 KiB chunk table), and at most
// one partly filled chunk per tensor.
constexpr int64_t kChunkSize = 65536;
// 512 threads x 4 elements a trip: 32 trips per full chunk.
constexpr int kThreads = 512;

// The columns every Adam per-tensor table starts with (adam_step_ and adam_step_lowp_): an op's own columns
// follow from kAdamOwn, and numel is last. Absent pointers (master without master params) are 0.
enum AdamCol : int {
  kAdamParam = 0,
  kAdamGrad = 1,
  kAdamExpAvg = 2,
  kAdamExpAvgSq = 3,
  kAdamMaster = 4,
  kAdamStep = 5,  // float32 step counter, already incremented for this step
  kAdamOwn = 6,
};

// adam_step_'s own column: max_exp_avg_sq (0 without amsgrad).
enum FullCol : int { kAdamMaxExpAvgSq = kAdamOwn, kAdamNumel = kAdamOwn + 1, kAdamCols = kAdamOwn + 2 };

// adam_step_lowp_'s own columns. Absmax pointers are 0 with bf16 states. kLowpIndex: the tensor's position in
// the op's lists (the stochastic-rounding key's input).
enum LowpCol : int {
  kLowpExpAvgAbsmax = kAdamOwn,
  kLowpExpAvgSqAbsmax = kAdamOwn + 1,
  kLowpIndex = kAdamOwn + 2,
  kLowpNumel = kAdamOwn + 3,
  kLowpCols = kAdamOwn + 4,
};

// Columns of the SGD per-tensor table. Absent pointers (momentum buffer without momentum, master without
// master params) are 0.
enum SgdCol : int { kSgdParam = 0, kSgdGrad = 1, kSgdBuf = 2, kSgdMaster = 3, kSgdNumel = 4, kSgdCols = 5 };

// Columns of the grad table (unscale_check_, grad_stats).
enum GradCol : int { kGradPtr = 0, kGradNumel = 1, kGradCols = 2 };

// Scalars of one Adam launch, shared by adam_step_ and adam_step_lowp_. Pointers are device fp32 scalars read in
// the kernel (what CUDA-graph capture needs); nullptr means "use the value field".
struct AdamCommonArgs {
  const int64_t* tensors;  // [n_tensors][kAdamCols or kLowpCols]
  const int64_t* chunks;   // [n_chunks][2]
  int64_t n_chunks;
  const float* lr_ptr;
  float lr;
  float decay;  // 1 - lr * weight_decay, used when lr_ptr is null
  const float* grad_scale_ptr;
  float grad_scale;
  bool has_grad_scale;
  const float* found_inf;  // the kernel does nothing when *found_inf != 0; nullptr: never skips
  float beta2;
  float one_minus_beta2;  // fp32(1 - beta2 in fp64), as torch passes value=1 - beta2
  float lerp_weight;      // fp32(1 - beta1)
  bool lerp_small;        // |lerp_weight| < 0.5: torch.lerp's choice of formula
  double beta1_64;        // the bias corrections are computed in fp64 (adam_math.cuh)
  double beta2_64;
  float eps;
  float weight_decay;
  double weight_decay64;  // for 1 - lr * weight_decay when lr is read in the kernel
  int wd_mode;            // 0 none, 1 L2 (Adam), 2 decoupled (AdamW)
  bool maximize;
  bool has_master;
};

struct AdamArgs : AdamCommonArgs {
  bool amsgrad;
};

struct AdamLowpArgs : AdamCommonArgs {
  bool eight_bit;  // uint8 codes + absmax, else bf16 states
  uint32_t seed;   // low 32 bits of the op's seed
};

// Scalars of one SGD launch; pointers as in AdamArgs.
struct SgdArgs {
  const int64_t* tensors;  // [n_tensors][kSgdCols]
  const int64_t* chunks;   // [n_chunks][2]
  int64_t n_chunks;
  const float* lr_ptr;
  float lr;
  const float* grad_scale_ptr;
  float grad_scale;
  bool has_grad_scale;
  const float* found_inf;  // the kernel does nothing when *found_inf != 0; nullptr: never skips
  float weight_decay;
  float momentum;
  float one_minus_dampening;  // fp32(1 - dampening in fp64), as torch passes alpha=1 - dampening
  int momentum_mode;          // 0 no momentum, 1 first step (buf = grad), 2 buf = momentum*buf + (1-d)*grad
  bool nesterov;
  bool maximize;
  bool has_master;
};

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

}  // namespace cuda
}  // namespace fastops

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>

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
template <>
struct Elem<__nv_bfloat16> {
  static __device__ __forceinline__ float load(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 store(float x) { return __float2bfloat16_rn(x); }
  static __device__ __forceinline__ float from_bits(unsigned int b) {
    return __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(b)));
  }
  static __device__ __forceinline__ unsigned int to_bits(float x) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  }
};
template <>
struct Elem<__half> {
  static __device__ __forceinline__ float load(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half store(float x) { return __float2half_rn(x); }
  static __device__ __forceinline__ float from_bits(unsigned int b) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(b)));
  }
  static __device__ __forceinline__ unsigned int to_bits(float x) { return __half_as_ushort(__float2half_rn(x)); }
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

// torch.maximum: nan if either operand is nan (fmaxf would drop it).
__device__ __forceinline__ float max_nan(float a, float b) { return (a != a || a > b) ? a : b; }

// |x| <= FLT_MAX is false exactly for inf and nan.
__device__ __forceinline__ bool finite(float x) { return fabsf(x) <= 3.402823466e+38f; }

}  // namespace detail
}  // namespace cuda
}  // namespace fastops
#endif  // __CUDACC__
