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

void sgd_step_(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& momentum_buffers, const std::vector<at::Tensor>& master_params,
               const at::Tensor& lr, double weight_decay, double momentum, double dampening, bool nesterov,
               bool maximize, bool is_first_step, const std::optional<at::Tensor>& grad_scale,
               const std::optional<at::Tensor>& found_inf) {
  const size_t n = params.size();
  if (n == 0) return;
  TORCH_CHECK(params[0].is_cpu(), "fastops.sgd_step_ (C++ CPU backend): params[0] is on ", params[0].device().str(),
              "; these kernels take CPU tensors");
  if (found_inf.has_value() && read_scalar(*found_inf) != 0) return;

  SgdConsts c{};
  c.neg_lr = static_cast<float>(-read_scalar(lr));
  c.weight_decay = static_cast<float>(weight_decay);
  c.wd = weight_decay != 0;
  c.momentum = static_cast<float>(momentum);
  c.one_minus_dampening = static_cast<float>(1 - dampening);
  c.mom = momentum == 0 ? 0 : (is_first_step ? 1 : 2);
  c.nesterov = nesterov && momentum != 0;
  c.grad = grad_scaling(grad_scale, maximize);

  const bool master = !master_params.empty();
  std::vector<SgdTensor> work(n);
  for (size_t i = 0; i < n; ++i) {
    SgdTensor& w = work[i];
    w.param = params[i].data_ptr();
    w.grad = grads[i].const_data_ptr();
    w.buf = c.mom ? static_cast<float*>(momentum_buffers[i].data_ptr()) : nullptr;
    w.master = master ? static_cast<float*>(master_params[i].data_ptr()) : nullptr;
    w.numel = params[i].numel();
    w.dtype = to_dtype(params[i].scalar_type());
  }

  const KernelTable& k = kernels();
  parallel_over(work, [&](const SgdTensor& t, int64_t b, int64_t e) { k.sgd(t, c, b, e); });
}

}  // namespace cpu
}  // namespace fastops
