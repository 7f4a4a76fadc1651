// Host-side helpers shared by adam.cpp, adam_lowp.cpp, sgd.cpp and amp.cpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include "cpu/kernels.h"
#include "fastops.h"

namespace fastops {
namespace cpu {

inline Dtype to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return Dtype::kBFloat16;
    case at::kHalf: return Dtype::kHalf;
    default: return Dtype::kFloat;
  }
}

// A scalar tensor's value: a direct load for CPU float32/float64, item() otherwise.
inline double read_scalar(const at::Tensor& t) {
  if (t.is_cpu() && t.numel() == 1) {
    if (t.scalar_type() == at::kFloat) return *static_cast<const float*>(t.const_data_ptr());
    if (t.scalar_type() == at::kDouble) return *static_cast<const double*>(t.const_data_ptr());
  }
  return t.item<double>();
}

inline GradScaling grad_scaling(const OptionalTensor& grad_scale, bool maximize) {
  GradScaling g{};
  g.has_scale = grad_scale.has_value();
  if (g.has_scale) {
    const float s = static_cast<float>(read_scalar(*grad_scale));
    g.div = maximize ? -s : s;
  }
  g.sign = maximize ? -1.0f : 1.0f;
  return g;
}

// Whether the tensors of a call are the CPU's: the op's check has held them to one device, and a call that reached
// this backend with another device's tensors (FASTOPS_BACKEND or a test forcing it) must not run.
inline void check_cpu(const TensorList& tensors, const char* op) {
  TORCH_CHECK(tensors.empty() || tensors[0].is_cpu(), "fastops.", op, " (C++ CPU backend): tensors are on ",
              tensors[0].device().str(), "; these kernels take CPU tensors");
}

// Whether the step runs: found_inf absent or 0 (a skipped step writes nothing).
inline bool step_runs(const OptionalTensor& found_inf) {
  return !found_inf.has_value() || read_scalar(*found_inf) == 0;
}

// The update's constants of adam_step_ and adam_step_lowp_ (amsgrad left false) at the step's lr.
template <class Args>
AdamConsts adam_consts(const Args& a, double lr) {
  AdamConsts c{};
  c.lerp_weight = static_cast<float>(1 - a.beta1);
  c.lerp_weight_m1 = c.lerp_weight - 1.0f;
  c.lerp_low = std::abs(c.lerp_weight) < 0.5f;
  c.beta2 = static_cast<float>(a.beta2);
  c.one_minus_beta2 = static_cast<float>(1 - a.beta2);
  c.eps = static_cast<float>(a.eps);
  c.l2 = a.weight_decay != 0 && !a.decoupled;
  c.weight_decay = static_cast<float>(a.weight_decay);
  c.decay = (a.weight_decay != 0 && a.decoupled) ? static_cast<float>(1 - lr * a.weight_decay) : 1.0f;
  c.amsgrad = false;
  c.grad = grad_scaling(a.grad_scale, a.maximize);
  return c;
}

// Tensor i's fields every Adam kernel takes (param, grad, master, numel, dtype), its step counter bumped by one in
// fp32 (as `step_t += 1`) and the step's -lr / bias_correction1 and sqrt(bias_correction2) from the new value: in fp64
// and rounded once, with std::pow, the libm pow the reference's Python `beta ** step` calls, so the scalars are the
// reference's.
template <class Work, class Args>
void adam_tensor(Work& w, size_t i, const Args& a, double lr) {
  // A CPU tensor (the op's check: the params' device).
  float* step = static_cast<float*>(a.state_steps[i].data_ptr());
  *step += 1.0f;
  w.neg_step_size = static_cast<float>(-(lr / (1 - std::pow(a.beta1, double(*step)))));
  w.bc2_sqrt = static_cast<float>(std::sqrt(1 - std::pow(a.beta2, double(*step))));
  w.param = a.params[i].data_ptr();
  w.grad = a.grads[i].const_data_ptr();
  w.master = a.master_params.empty() ? nullptr : static_cast<float*>(a.master_params[i].data_ptr());
  w.numel = a.params[i].numel();
  w.dtype = to_dtype(a.params[i].scalar_type());
}

// All tensors of a call laid end to end in one index space, each padded to a multiple of kAlign elements
// (so a work boundary inside a tensor falls on a 64-byte line for every dtype), cut into units of kUnit
// elements. at::parallel_for over units then balances 100 small tensors like one large one, and a unit's
// position never depends on the thread count. adam_step_lowp_ pads to 256 instead (`align`), so that no
// 8-bit block of 256 elements, whose absmax one thread computes, is split between units.
struct FlatLayout {
  static constexpr int64_t kAlign = 32;
  static constexpr int64_t kUnit = 16384;
  static_assert(kUnit % 256 == 0, "a unit holds whole 8-bit blocks");

  std::vector<int64_t> start;  // start[i]: first flat index of tensor i; start[n]: padded total
  std::vector<int64_t> numel;

  template <class NumelOf>
  FlatLayout(size_t n, NumelOf numel_of, int64_t align = kAlign) : start(n + 1), numel(n) {
    int64_t pos = 0;
    for (size_t i = 0; i < n; ++i) {
      start[i] = pos;
      numel[i] = numel_of(i);
      pos += (numel[i] + align - 1) / align * align;
    }
    start[n] = pos;
  }

  int64_t units() const { return (start.back() + kUnit - 1) / kUnit; }

  // Calls f(i, begin, end) for each tensor i overlapping flat range [lo, hi), with [begin, end) its local
  // element range (padding excluded), in tensor order.
  template <class F>
  void for_each(int64_t lo, int64_t hi, F&& f) const {
    const size_t n = numel.size();
    size_t i = static_cast<size_t>(std::upper_bound(start.begin(), start.end() - 1, lo) - start.begin()) - 1;
    for (; i < n && start[i] < hi; ++i) {
      const int64_t b = std::max(lo, start[i]) - start[i];
      const int64_t e = std::min(hi - start[i], numel[i]);
      if (b < e) f(i, b, e);
    }
  }
};

// kernel(work[i], begin, end) over every element of every tensor of a call, in one at::parallel_for over a
// FlatLayout of work[i].numel.
template <class Work, class Kernel>
void parallel_over(const std::vector<Work>& work, const Kernel& kernel, int64_t align = FlatLayout::kAlign) {
  const FlatLayout layout(work.size(), [&](size_t i) { return work[i].numel; }, align);
  at::parallel_for(0, layout.units(), 1, [&](int64_t ub, int64_t ue) {
    layout.for_each(ub * FlatLayout::kUnit, ue * FlatLayout::kUnit,
                    [&](size_t i, int64_t b, int64_t e) { kernel(work[i], b, e); });
  });
}

}  // namespace cpu
}  // namespace fastops
