// The host side every CUDA op shares, in ATen alone (no CUDA runtime), so that csrc/cuda_math.cpp, which runs the
// kernels' math on CPU tensors, sets a launch up exactly as the binding (binding.cpp) does: where each scalar is
// read, the step counters, the Adam launch scalars and the per-tensor table rows (args.h's layout).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "cuda/args.h"
#include "fastops.h"

namespace fastops {
namespace cuda {

inline ScalarKind kind_of(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return ScalarKind::kBFloat16;
    case at::kHalf: return ScalarKind::kFloat16;
    default: return ScalarKind::kFloat32;  // the op's check: float32, bfloat16 or float16
  }
}

inline int64_t address(const void* p) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(p)); }

// Tensor indices grouped by dtype, in the order fp32, bf16, fp16: one launch per non-empty group.
inline std::vector<std::pair<at::ScalarType, std::vector<size_t>>> group_by_dtype(const TensorList& ts) {
  std::vector<std::pair<at::ScalarType, std::vector<size_t>>> groups = {
      {at::kFloat, {}}, {at::kBFloat16, {}}, {at::kHalf, {}}};
  for (size_t i = 0; i < ts.size(); ++i) {
    for (auto& g : groups) {
      if (g.first == ts[i].scalar_type()) g.second.push_back(i);
    }
  }
  groups.erase(std::remove_if(groups.begin(), groups.end(), [](const auto& g) { return g.second.empty(); }),
               groups.end());
  return groups;
}

// A one-element tensor the kernel reads: through a pointer when it is on the tensors' device (as fp32),
// else its value, read here from the CPU (no device sync).
struct ScalarArg {
  at::Tensor on_device;
  double value = 0;
  const float* ptr() const { return on_device.defined() ? on_device.const_data_ptr<float>() : nullptr; }
};

inline ScalarArg scalar_arg(const at::Tensor& t, const at::Device& device) {
  ScalarArg s;
  if (t.device() == device) {
    // A device-side cast when needed (a queued op, no sync); the cast copy lives until the launch is queued,
    // and the caching allocator orders its reuse after that launch.
    s.on_device = t.scalar_type() == at::kFloat ? t : t.to(at::kFloat);
  } else {
    s.value = t.item<double>();  // a CPU tensor (the op's check): no device sync
  }
  return s;
}

// lr, grad_scale and found_inf of an optimizer step. skip: found_inf is a CPU tensor that is set, so there is
// nothing to launch.
struct LaunchScalars {
  ScalarArg lr, scale, inf;
  bool skip = false;
};

template <class OpArgs>
LaunchScalars launch_scalars(const OpArgs& a, const at::Device& device) {
  LaunchScalars sc;
  sc.lr = scalar_arg(a.lr, device);
  if (a.grad_scale.has_value()) sc.scale = scalar_arg(*a.grad_scale, device);
  if (a.found_inf.has_value()) {
    sc.inf = scalar_arg(*a.found_inf, device);
    sc.skip = !sc.inf.on_device.defined() && sc.inf.value != 0;
  }
  return sc;
}

// The step counters of a step that runs: +1, or +(found_inf == 0) where found_inf is on the device (a queued op; the
// kernels then skip the whole step themselves).
inline void bump_steps(const TensorList& steps, const LaunchScalars& sc) {
  if (sc.inf.on_device.defined()) {
    at::_foreach_add_(steps, sc.inf.on_device.reshape({}).eq(at::Scalar(0.0)).to(at::kFloat));
  } else {
    at::_foreach_add_(steps, at::Scalar(1.0));
  }
}

// The scalars every Adam kernel takes (args.h's AdamCommonArgs), from the op's arguments (adam_step_'s and
// adam_step_lowp_'s share these fields).
template <class OpArgs>
void set_adam_scalars(AdamCommonArgs& c, const OpArgs& a, const LaunchScalars& sc) {
  c.lr_ptr = sc.lr.ptr();
  c.lr = static_cast<float>(sc.lr.value);
  c.decay = static_cast<float>(1 - sc.lr.value * a.weight_decay);
  c.grad_scale_ptr = sc.scale.ptr();
  c.grad_scale = a.grad_scale.has_value() ? static_cast<float>(sc.scale.value) : 1.0f;
  c.has_grad_scale = a.grad_scale.has_value();
  c.found_inf = sc.inf.ptr();
  c.beta2 = static_cast<float>(a.beta2);
  c.one_minus_beta2 = static_cast<float>(1 - a.beta2);
  c.lerp_weight = static_cast<float>(1 - a.beta1);
  c.lerp_small = std::abs(c.lerp_weight) < 0.5f;
  c.beta1_64 = a.beta1;
  c.beta2_64 = a.beta2;
  c.eps = static_cast<float>(a.eps);
  c.weight_decay = static_cast<float>(a.weight_decay);
  c.weight_decay64 = a.weight_decay;
  c.wd_mode = a.weight_decay == 0 ? 0 : (a.decoupled ? 2 : 1);
  c.maximize = a.maximize;
  c.has_master = !a.master_params.empty();
}

// The per-tensor table of the Adam tensors `idx`: the common columns (args.h's AdamCol), then own(i, row) (tensor
// i's own columns), then numel.
template <class OpArgs, class Own>
std::vector<int64_t> adam_rows(const OpArgs& a, const std::vector<size_t>& idx, const Own& own) {
  std::vector<int64_t> flat;
  for (size_t i : idx) {
    flat.push_back(address(a.params[i].data_ptr()));
    flat.push_back(address(a.grads[i].const_data_ptr()));
    flat.push_back(address(a.exp_avgs[i].data_ptr()));
    flat.push_back(address(a.exp_avg_sqs[i].data_ptr()));
    flat.push_back(a.master_params.empty() ? 0 : address(a.master_params[i].data_ptr()));
    flat.push_back(address(a.state_steps[i].data_ptr()));
    own(i, flat);
    flat.push_back(a.params[i].numel());
  }
  return flat;
}

// adam_step_'s own column: max_exp_avg_sq (0 without amsgrad).
inline auto adam_own(const AdamStepArgs& a) {
  return [&a](size_t i, std::vector<int64_t>& row) {
    row.push_back(a.amsgrad ? address(a.max_exp_avg_sqs[i].data_ptr()) : 0);
  };
}

// adam_step_lowp_'s own columns: the absmax pointers (0 with bf16 states), the tensor's index in the op's lists.
inline auto lowp_own(const AdamStepLowpArgs& a, bool eight_bit) {
  return [&a, eight_bit](size_t i, std::vector<int64_t>& row) {
    row.push_back(eight_bit ? address(a.exp_avg_absmax[i].data_ptr()) : 0);
    row.push_back(eight_bit ? address(a.exp_avg_sq_absmax[i].data_ptr()) : 0);
    row.push_back(static_cast<int64_t>(i));
  };
}

// adam_step_lowp_'s launch arguments beyond the common scalars.
inline AdamLowpArgs lowp_args(const AdamStepLowpArgs& a) {
  AdamLowpArgs k{};
  k.format = *state_format(a.exp_avgs);  // 8-bit or bf16: the op's check
  k.seed = static_cast<uint32_t>(static_cast<uint64_t>(a.seed) & 0xFFFFFFFFu);
  return k;
}

}  // namespace cuda
}  // namespace fastops
