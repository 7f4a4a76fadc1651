// fastops.adam_step_ on the CPU: checks, step counters and bias corrections on the host, then one
// at::parallel_for over all elements of all tensors (kernels_isa.h does the per-element work).
//
// Against torch._fused_adamw_ (one parallel region per tensor) the single region over a flat index space
// is what wins for many tensors; at memory bandwidth both move the same 28 bytes per fp32 param.
#include <cmath>

#include <c10/util/Exception.h>

#include "cpu/host.h"
#include "cpu/kernels.h"
#include "fastops.h"

namespace fastops {
namespace cpu {

void adam_step_(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                const std::vector<at::Tensor>& max_exp_avg_sqs, const std::vector<at::Tensor>& state_steps,
                const std::vector<at::Tensor>& master_params, const at::Tensor& lr, double beta1, double beta2,
                double eps, double weight_decay, bool amsgrad, bool maximize, bool decoupled,
                const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  check_adam_args(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, master_params, amsgrad);
  const size_t n = params.size();
  if (n == 0) return;
  TORCH_CHECK(params[0].is_cpu(), "fastops.adam_step_ (C++ CPU backend): params[0] is on ", params[0].device().str(),
              "; these kernels take CPU tensors");
  const at::Device device = params[0].device();
  check_scalar(lr, "adam_step_", "lr", device);
  if (grad_scale.has_value()) check_scalar(*grad_scale, "adam_step_", "grad_scale", device);
  if (found_inf.has_value()) check_scalar(*found_inf, "adam_step_", "found_inf", device);
  if (found_inf.has_value() && read_scalar(*found_inf) != 0) return;
  const double lr_v = read_scalar(lr);

  AdamConsts c{};
  c.lerp_weight = static_cast<float>(1 - beta1);
  c.lerp_weight_m1 = c.lerp_weight - 1.0f;
  c.lerp_low = std::abs(c.lerp_weight) < 0.5f;
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1 - beta2);
  c.eps = static_cast<float>(eps);
  c.l2 = weight_decay != 0 && !decoupled;
  c.weight_decay = static_cast<float>(weight_decay);
  c.decay = (weight_decay != 0 && decoupled) ? static_cast<float>(1 - lr_v * weight_decay) : 1.0f;
  c.amsgrad = amsgrad;
  c.grad = grad_scaling(grad_scale, maximize);

  const bool master = !master_params.empty();
  std::vector<AdamTensor> work(n);
  for (size_t i = 0; i < n; ++i) {
    // The step counter is incremented in fp32 (as `step_t += 1`) and read back as the exponent.
    const at::Tensor& st = state_steps[i];
    double step;
    if (st.is_cpu()) {
      float* sp = static_cast<float*>(st.data_ptr());
      *sp += 1.0f;
      step = *sp;
    } else {
      st.add_(1);
      step = st.item<double>();
    }
    const double bc1 = 1 - std::pow(beta1, step);
    const double bc2 = 1 - std::pow(beta2, step);
    AdamTensor& w = work[i];
    w.param = params[i].data_ptr();
    w.grad = grads[i].const_data_ptr();
    w.exp_avg = static_cast<float*>(exp_avgs[i].data_ptr());
    w.exp_avg_sq = static_cast<float*>(exp_avg_sqs[i].data_ptr());
    w.max_exp_avg_sq = amsgrad ? static_cast<float*>(max_exp_avg_sqs[i].data_ptr()) : nullptr;
    w.master = master ? static_cast<float*>(master_params[i].data_ptr()) : nullptr;
    w.numel = params[i].numel();
    w.dtype = to_dtype(params[i].scalar_type());
    w.neg_step_size = static_cast<float>(-(lr_v / bc1));
    w.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  }

  const KernelTable& k = kernels();
  parallel_over(work, [&](const AdamTensor& t, int64_t b, int64_t e) { k.adam(t, c, b, e); });
}

}  // namespace cpu
}  // namespace fastops
