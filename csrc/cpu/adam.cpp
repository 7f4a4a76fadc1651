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

void adam_step_(const AdamStepArgs& a) {
  const size_t n = a.params.size();
  check_cpu(a.params, "adam_step_");
  if (n == 0 || !step_runs(a.found_inf)) return;
  const double lr = read_scalar(a.lr);
  AdamConsts c = adam_consts(a, lr);
  c.amsgrad = a.amsgrad;

  std::vector<AdamTensor> work(n);
  for (size_t i = 0; i < n; ++i) {
    AdamTensor& w = work[i];
    adam_tensor(w, i, a, lr);
    w.exp_avg = static_cast<float*>(a.exp_avgs[i].data_ptr());
    w.exp_avg_sq = static_cast<float*>(a.exp_avg_sqs[i].data_ptr());
    w.max_exp_avg_sq = a.amsgrad ? static_cast<float*>(a.max_exp_avg_sqs[i].data_ptr()) : nullptr;
  }

  const KernelTable& k = kernels();
  parallel_over(work, [&](const AdamTensor& t, int64_t b, int64_t e) { k.adam(t, c, b, e); });
}

}  // namespace cpu
}  // namespace fastops
