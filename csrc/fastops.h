// Declarations shared by the bindings, the C++ CPU kernels and the CUDA bindings.
#pragma once

#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <pybind11/pybind11.h>

namespace fastops {

// The argument checks of fastops/_checks.py, with the same conditions, order and messages, so that a bad
// call fails the same way on every backend. Device-agnostic (csrc/cpu/checks.cpp). fastops/_ops.py runs them
// once per op call, before any backend (as torch.ops.fastops_checks.*, registered in checks.cpp); the backends do not
// call them again and check only what guards memory (the device of the tensors they write).
void check_adam_args(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                     const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                     const std::vector<at::Tensor>& max_exp_avg_sqs, const std::vector<at::Tensor>& state_steps,
                     const std::vector<at::Tensor>& master_params, bool amsgrad);
void check_adam_lowp_args(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                          const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                          const std::vector<at::Tensor>& exp_avg_absmax, const std::vector<at::Tensor>& exp_avg_sq_absmax,
                          const std::vector<at::Tensor>& state_steps, const std::vector<at::Tensor>& master_params);
void check_sgd_args(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                    const std::vector<at::Tensor>& momentum_buffers, const std::vector<at::Tensor>& master_params,
                    double momentum);
// op is the name used in the messages, e.g. "unscale_check_" -> "fastops.unscale_check_: ...".
void check_grads(const std::vector<at::Tensor>& grads, const char* op);
// A one-element floating tensor on `device` or the CPU (kernels read it through a pointer or on the host).
void check_scalar(const at::Tensor& t, const char* op, const char* what, const at::Device& device);
// One float32 element on `device`: the kernels write 1.0 into it.
void check_found_inf(const at::Tensor& found_inf, const char* op, const at::Device& device);

namespace cpu {

// The ops, with the positional signatures of fastops/reference.py (semantics: fastops/_ops.py).
void adam_step_(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                const std::vector<at::Tensor>& max_exp_avg_sqs, const std::vector<at::Tensor>& state_steps,
                const std::vector<at::Tensor>& master_params, const at::Tensor& lr, double beta1, double beta2,
                double eps, double weight_decay, bool amsgrad, bool maximize, bool decoupled,
                const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf);

void adam_step_lowp_(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                     const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                     const std::vector<at::Tensor>& exp_avg_absmax, const std::vector<at::Tensor>& exp_avg_sq_absmax,
                     const std::vector<at::Tensor>& state_steps, const std::vector<at::Tensor>& master_params,
                     const at::Tensor& lr, double beta1, double beta2, double eps, double weight_decay, bool maximize,
                     bool decoupled, int64_t seed, const std::optional<at::Tensor>& grad_scale,
                     const std::optional<at::Tensor>& found_inf);
// _quant.sr_key(seed, index): the 32-bit stochastic-rounding key of the tensor at `index` of a call.
uint32_t sr_key(int64_t seed, int64_t index);

void sgd_step_(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& momentum_buffers, const std::vector<at::Tensor>& master_params,
               const at::Tensor& lr, double weight_decay, double momentum, double dampening, bool nesterov,
               bool maximize, bool is_first_step, const std::optional<at::Tensor>& grad_scale,
               const std::optional<at::Tensor>& found_inf);

void unscale_check_(const std::vector<at::Tensor>& grads, const at::Tensor& found_inf, const at::Tensor& inv_scale);

at::Tensor grad_stats(const std::vector<at::Tensor>& grads, const std::optional<at::Tensor>& inv_scale);

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

}  // namespace cpu

namespace cuda {
// Defined in csrc/cuda/binding.cpp; compiled and called only when built with -DWITH_CUDA.
void register_bindings(pybind11::module_ m);
// linear_cross_entropy's (csrc/cuda/linear_ce_binding.cpp), called by register_bindings.
void register_linear_ce(pybind11::module_ m);
}  // namespace cuda

}  // namespace fastops

#include <tuple>

namespace fastops {
namespace cpu {
// linear_cross_entropy and its backward on CPU tensors, with the schemas' positional signatures (semantics:
// fastops/_specs/linear_ce.py; the driver: csrc/linear_ce.h).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& target, const std::optional<at::Tensor>& bias,
    int64_t ignore_index, int64_t reduction, double label_smoothing, double normalizer, bool grad_x,
    bool grad_weight, bool grad_bias, int64_t chunk_rows);
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_backward(
    const at::Tensor& grad_loss, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& target,
    const std::optional<at::Tensor>& bias, int64_t ignore_index, int64_t reduction,
    double label_smoothing, double normalizer, bool grad_x, bool grad_weight, bool grad_bias, int64_t chunk_rows);
}  // namespace cpu
}  // namespace fastops
