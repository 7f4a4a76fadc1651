// Declarations shared by the bindings, the C++ CPU kernels and the CUDA bindings.
#pragma once

#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <pybind11/pybind11.h>

#include "generated/op_args.h"
#include "state_format.h"

namespace fastops {

// The format of an op's states from the dtype of its exp_avgs (fastops/_quant.py's StateFormat.of): nullopt for a
// dtype no format stores; a call without tensors counts as 8-bit (its absmax lists are then as empty as bf16's).
std::optional<StateFormat> state_format(const TensorList& exp_avgs);

namespace cpu {

// The ops (semantics: fastops/_ops.py). Each runs after the op's check(args) (the generated binding calls both), so
// they assume valid arguments.
void adam_step_(const AdamStepArgs& a);
void adam_step_lowp_(const AdamStepLowpArgs& a);
void sgd_step_(const SgdStepArgs& a);
void unscale_check_(const UnscaleCheckArgs& a);
at::Tensor grad_stats(const GradStatsArgs& a);
at::Tensor dropout(const DropoutArgs& a);

// fastops/_specs/dropout.py's constants of a dropout call, for x's dtype.
struct DropoutConsts {
  uint32_t key;
  uint32_t threshold;
  float scale;
};
DropoutConsts dropout_consts(double p, int64_t seed, at::ScalarType dtype);

// _quant.sr_key(seed, index): the 32-bit stochastic-rounding key of the tensor at `index` of a call.
uint32_t sr_key(int64_t seed, int64_t index);

// "avx512", "avx2" or "default": the kernel set picked at load time for this CPU.
const char* capability();

// The caching layer over torch's CPU allocator for blocks of 8 MiB and more (csrc/cpu/cache.cpp).
struct CacheStats {
  int64_t hits = 0;      // allocations served from the cache
  int64_t misses = 0;    // cacheable allocations that had to map a new block
  int64_t released = 0;  // cached blocks given back to the OS (limit, empty, failed allocation)
  size_t cached_bytes = 0;
  size_t limit_bytes = 0;
};
// Installs the cache as torch's CPU allocator on the first call (later calls change the limit); returns
// whether it is the allocator torch now uses.
bool cpu_cache_enable(int64_t limit_bytes);
CacheStats cpu_cache_stats();
void cpu_cache_empty();
// Whether torch's CPU allocator is this cache now (fastops.accelerate on a CPU device installs it).
bool cpu_cache_active();

}  // namespace cpu

namespace cuda {
// Defined in csrc/cuda/binding.cpp; compiled and called only when built with -DWITH_CUDA.
void register_bindings(pybind11::module_ m);
// The CUDA kernels' math run on CPU tensors (csrc/cuda_math.cpp), in every build.
void register_cuda_math(pybind11::module_ m);
// linear_cross_entropy's (csrc/cuda/linear_ce_binding.cpp), called by register_bindings.
void register_linear_ce(pybind11::module_ m);
}  // namespace cuda

}  // namespace fastops

#include <tuple>

