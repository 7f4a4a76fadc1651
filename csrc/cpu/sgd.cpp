// fastops.sgd_step_ on the CPU: scalars on the host, then one at::parallel_for over all elements
// of all tensors (FlatLayout; kernels_isa.h does the per-element work).
//
// torch._fused_sgd_ runs one parallel region per tensor; a single region over a flat index space keeps both
// threads busy through 100 small tensors as through one large one.
#include <c10/util/Exception.h>

#include "cpu/host.h"
#include "cpu/kernels.h"
#include "fastops.h"

namespace fastops {
namespace cpu {

void sgd_step_(const SgdStepArgs& a) {
  const size_t n = a.params.size();
  check_cpu(a.params, "sgd_step_");
  if (n == 0 || !step_runs(a.found_inf)) return;

  SgdConsts c{};
  c.neg_lr = static_cast<float>(-read_scalar(a.lr));
  c.weight_decay = static_cast<float>(a.weight_decay);
  c.wd = a.weight_decay != 0;
  c.momentum = static_cast<float>(a.momentum);
  c.one_minus_dampening = static_cast<float>(1 - a.dampening);
  c.mom = a.momentum == 0 ? 0 : (a.is_first_step ? 1 : 2);
  c.nesterov = a.nesterov && a.momentum != 0;
  c.grad = grad_scaling(a.grad_scale, a.maximize);

  const bool master = !a.master_params.empty();
  std::vector<SgdTensor> work(n);
  for (size_t i = 0; i < n; ++i) {
    SgdTensor& w = work[i];
    w.param = a.params[i].data_ptr();
    w.grad = a.grads[i].const_data_ptr();
    w.buf = c.mom ? static_cast<float*>(a.momentum_buffers[i].data_ptr()) : nullptr;
    w.master = master ? static_cast<float*>(a.master_params[i].data_ptr()) : nullptr;
    w.numel = a.params[i].numel();
    w.dtype = to_dtype(a.params[i].scalar_type());
  }

  const KernelTable& k = kernels();
  parallel_over(work, [&](const SgdTensor& t, int64_t b, int64_t e) { k.sgd(t, c, b, e); });
}

}  // namespace cpu
}  // namespace fastops
