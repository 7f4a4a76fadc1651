// fastops.adam_step_ on the CPU: step counters and bias corrections on the host, then one
// at::parallel_for over all elements of all tensors (kernels_isa.h does the per-element work).
//
// Against torch._fused_adamw_ (one parallel region per tensor) the single region over a flat index space
// is what wins for many tensors; at memory bandwidth both move the same 28 bytes per fp32 param.
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
  const size_t n = params.size();
  if (n == 0) return;
  AdamConsts c;
  double lr_v;
  if (!adam_host_setup("adam_step_", params, lr, beta1, beta2, eps, weight_decay, maximize, decoupled, grad_scale,
                       found_inf, c, lr_v)) {
    return;
  }
  c.amsgrad = amsgrad;

  std::vector<AdamTensor> work(n);
  for (size_t i = 0; i < n; ++i) {
    AdamTensor& w = work[i];
    adam_tensor(w, i, params, grads, master_params, state_steps, lr_v, beta1, beta2);
    w.exp_avg = static_cast<float*>(exp_avgs[i].data_ptr());
    w.exp_avg_sq = static_cast<float*>(exp_avg_sqs[i].data_ptr());
    w.max_exp_avg_sq = amsgrad ? static_cast<float*>(max_exp_avg_sqs[i].data_ptr()) : nullptr;
  }

  const KernelTable& k = kernels();
  parallel_over(work, [&](const AdamTensor& t, int64_t b, int64_t e) { k.adam(t, c, b, e); });
}

}  // namespace cpu
}  // namespace fastops
