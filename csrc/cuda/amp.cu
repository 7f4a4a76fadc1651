// fastops.unscale_check_ and fastops.grad_stats on CUDA, over the grad table and chunk table of
// kernels.cuh, one launch per grad dtype.
//
// grad_stats is deterministic without float atomics: the first pass writes one partial per chunk (not
// per block, so the result does not depend on the grid size), and the second pass is one block that
// folds the partials in a fixed order and a fixed shuffle tree.
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels.cuh"

namespace fastops {
namespace cuda {
namespace {

using detail::Elem;

// One chunk of the grad table: its grad pointer and [start, end) of the elements the chunk covers.
template <typename T>
struct GradChunk {
  T* g;
  int64_t start, end;
};

template <typename T>
__device__ __forceinline__ GradChunk<T> grad_chunk(const int64_t* tensors, const int64_t* chunks, int64_t c) {
  const int64_t t = chunks[2 * c];
  const int64_t start = chunks[2 * c + 1] * kChunkSize;
  const int64_t numel = tensors[t * kGradCols + kGradNumel];
  return {reinterpret_cast<T*>(tensors[t * kGradCols + kGradPtr]), start,
          numel < start + kChunkSize ? numel : start + kChunkSize};
}

// The block's threads over a chunk: 4 elements at a time through vec(i) where the grad is aligned for 4-wide
// loads, then the rest one at a time through one(i).
template <typename T, typename Vec, typename One>
__device__ __forceinline__ void walk_chunk(const GradChunk<T>& ch, Vec vec, One one) {
  int64_t scalar_from = ch.start;
  if (detail::aligned(ch.g, 4 * sizeof(T))) {
    const int64_t vec_end = ch.start + (ch.end - ch.start) / 4 * 4;
    for (int64_t i = ch.start + 4 * static_cast<int64_t>(threadIdx.x); i < vec_end;
         i += 4 * static_cast<int64_t>(blockDim.x)) {
      vec(i);
    }
    scalar_from = vec_end;
  }
  for (int64_t i = scalar_from + threadIdx.x; i < ch.end; i += blockDim.x) one(i);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    unscale_check_kernel(const int64_t* tensors, const int64_t* chunks, int64_t n_chunks, float* found_inf,
                         const float* inv_scale_ptr, float inv_scale_value) {
  const float inv = inv_scale_ptr != nullptr ? *inv_scale_ptr : inv_scale_value;
  bool bad = false;
  for (int64_t c = blockIdx.x; c < n_chunks; c += gridDim.x) {
    const GradChunk<T> ch = grad_chunk<T>(tensors, chunks, c);
    T* g = ch.g;
    walk_chunk(
        ch,
        [&](int64_t i) {
          float x[4];
          detail::load4<false>(g + i, x);
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            // Checked as it came in, as torch's AMP kernel does; fp32 multiply, one rounding on the store.
            bad |= !detail::finite(x[k]);
            x[k] = __fmul_rn(x[k], inv);
          }
          detail::store4(g + i, x);
        },
        [&](int64_t i) {
          const float x = Elem<T>::load(g[i]);
          bad |= !detail::finite(x);
          g[i] = Elem<T>::store(__fmul_rn(x, inv));
        });
  }
  // Only ever 1.0f: racing stores from several threads agree, and nothing clears the flag.
  if (bad) *found_inf = 1.0f;
}

// Running statistics of one thread, then of a warp and a block. amax leaves nans out; has_nan puts them
// back at the end, so max |g| is nan exactly when some element is (as torch's max).
struct Stats {
  float sq;
  float amax;
  int has_nan;
  int bad;
};

__device__ __forceinline__ Stats combine(const Stats& a, const Stats& b) {
  return Stats{__fadd_rn(a.sq, b.sq), fmaxf(a.amax, b.amax), a.has_nan | b.has_nan, a.bad | b.bad};
}

// x as it is decides the inf/nan flag; the norm and max are of u = x * inv, unscaled before squaring (a
// scaled fp32 grad above 1.8e19, which a GradScaler reaches after enough growth, would square to inf).
__device__ __forceinline__ void accumulate(Stats& s, float x, float inv) {
  s.bad |= !detail::finite(x);
  const float u = __fmul_rn(x, inv);
  const bool is_nan = u != u;
  s.sq = fmaf(u, u, s.sq);
  if (!is_nan) s.amax = fmaxf(s.amax, fabsf(u));
  s.has_nan |= is_nan;
}

// Block-wide fold with a fixed shape; the result is valid in thread 0. Ends with a barrier so the next
// call may reuse the shared buffer.
__device__ Stats warp_reduce(Stats s) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    Stats o;
    o.sq = __shfl_down_sync(0xffffffffu, s.sq, off);
    o.amax = __shfl_down_sync(0xffffffffu, s.amax, off);
    o.has_nan = __shfl_down_sync(0xffffffffu, s.has_nan, off);
    o.bad = __shfl_down_sync(0xffffffffu, s.bad, off);
    s = combine(s, o);
  }
  return s;
}

__device__ Stats block_reduce(Stats s) {
  __shared__ Stats warp_sums[kThreads / 32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  s = warp_reduce(s);
  if (lane == 0) warp_sums[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = lane < static_cast<int>(blockDim.x / 32) ? warp_sums[lane] : Stats{0.0f, 0.0f, 0, 0};
    s = warp_reduce(s);
  }
  __syncthreads();
  return s;
}

__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fc00000); }

template <typename T>
__global__ void __launch_bounds__(kThreads)
    grad_stats_partials_kernel(const int64_t* tensors, const int64_t* chunks, int64_t n_chunks, float* partials,
                               int64_t first_partial, const float* inv_scale_ptr, float inv_scale_value) {
  const float inv = inv_scale_ptr != nullptr ? *inv_scale_ptr : inv_scale_value;
  for (int64_t c = blockIdx.x; c < n_chunks; c += gridDim.x) {
    const GradChunk<const T> ch = grad_chunk<const T>(tensors, chunks, c);
    const T* g = ch.g;
    Stats s{0.0f, 0.0f, 0, 0};
    walk_chunk(
        ch,
        [&](int64_t i) {
          float x[4];
          detail::load4<true>(g + i, x);
#pragma unroll
          for (int k = 0; k < 4; ++k) accumulate(s, x[k], inv);
        },
        [&](int64_t i) { accumulate(s, detail::load_ro(g + i), inv); });
    s = block_reduce(s);
    if (threadIdx.x == 0) {
      float* out = partials + 3 * (first_partial + c);
      out[0] = s.sq;
      out[1] = s.has_nan ? quiet_nan() : s.amax;
      out[2] = s.bad ? 1.0f : 0.0f;
    }
  }
}

__global__ void __launch_bounds__(kThreads) grad_stats_reduce_kernel(const float* partials, int64_t n, float* out) {
  Stats s{0.0f, 0.0f, 0, 0};
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float* q = partials + 3 * i;
    const float amax = q[1];
    s.sq = __fadd_rn(s.sq, q[0]);
    if (amax != amax) {
      s.has_nan = 1;
    } else {
      s.amax = fmaxf(s.amax, amax);
    }
    s.bad |= q[2] != 0.0f;
  }
  s = block_reduce(s);
  if (threadIdx.x == 0) {
    out[0] = s.sq;
    out[1] = s.has_nan ? quiet_nan() : s.amax;
    out[2] = s.bad ? 1.0f : 0.0f;
  }
}

int grid_for(int64_t n_chunks, int max_blocks) {
  return static_cast<int>(n_chunks < max_blocks ? n_chunks : max_blocks);
}

}  // namespace

cudaError_t unscale_check(ScalarKind kind, const int64_t* tensors, const int64_t* chunks, int64_t n_chunks,
                          float* found_inf, const float* inv_scale_ptr, float inv_scale, int max_blocks,
                          cudaStream_t stream) {
  if (n_chunks == 0) return cudaSuccess;
  const int blocks = grid_for(n_chunks, max_blocks);
  return detail::launch_for_kind(kind, [&](auto t) {
    unscale_check_kernel<typename decltype(t)::type>
        <<<blocks, kThreads, 0, stream>>>(tensors, chunks, n_chunks, found_inf, inv_scale_ptr, inv_scale);
  });
}

cudaError_t grad_stats_partials(ScalarKind kind, const int64_t* tensors, const int64_t* chunks, int64_t n_chunks,
                                float* partials, int64_t first_partial, const float* inv_scale_ptr, float inv_scale,
                                int max_blocks, cudaStream_t stream) {
  if (n_chunks == 0) return cudaSuccess;
  const int blocks = grid_for(n_chunks, max_blocks);
  return detail::launch_for_kind(kind, [&](auto t) {
    grad_stats_partials_kernel<typename decltype(t)::type>
        <<<blocks, kThreads, 0, stream>>>(tensors, chunks, n_chunks, partials, first_partial, inv_scale_ptr, inv_scale);
  });
}

cudaError_t grad_stats_reduce(const float* partials, int64_t n_partials, float* out, cudaStream_t stream) {
  // Run even for n_partials == 0, so out is always written (zeros).
  grad_stats_reduce_kernel<<<1, kThreads, 0, stream>>>(partials, n_partials, out);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace fastops
