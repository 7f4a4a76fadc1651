// fastops.unscale_check_ and fastops.grad_stats on the CPU: one at::parallel_for over all elements of all
// grads (FlatLayout), the per-element work in kernels_isa.h.
#include <atomic>
#include <cstring>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include "cpu/host.h"
#include "cpu/kernels.h"
#include "fastops.h"

namespace fastops {
namespace cpu {

void unscale_check_(const UnscaleCheckArgs& a) {
  const TensorList& grads = a.grads;
  check_cpu(grads, "unscale_check_");
  if (grads.empty()) return;
  const float inv = static_cast<float>(read_scalar(a.inv_scale));
  // x * 1.0f == x for every non-nan x (and nan stays nan), so a unit scale only needs the check: one read
  // instead of a read and a write.
  const bool write = inv != 1.0f;
  const size_t n = grads.size();
  std::vector<void*> ptrs(n);
  std::vector<Dtype> dts(n);
  for (size_t i = 0; i < n; ++i) {
    ptrs[i] = grads[i].data_ptr();
    dts[i] = to_dtype(grads[i].scalar_type());
  }
  const FlatLayout layout(n, [&](size_t i) { return grads[i].numel(); });
  const KernelTable& k = kernels();
  std::atomic<bool> any{false};
  at::parallel_for(0, layout.units(), 1, [&](int64_t ub, int64_t ue) {
    bool bad = false;
    layout.for_each(ub * FlatLayout::kUnit, ue * FlatLayout::kUnit, [&](size_t i, int64_t b, int64_t e) {
      const size_t es = dts[i] == Dtype::kFloat ? 4 : 2;
      bad |= k.unscale(static_cast<char*>(ptrs[i]) + b * es, dts[i], e - b, inv, write);
    });
    if (bad) any.store(true, std::memory_order_relaxed);
  });
  if (any.load()) a.found_inf.fill_(1.0);
}

at::Tensor grad_stats(const GradStatsArgs& a) {
  const TensorList& grads = a.grads;
  check_cpu(grads, "grad_stats");
  const float inv = a.inv_scale.has_value() ? static_cast<float>(read_scalar(*a.inv_scale)) : 1.0f;
  const size_t n = grads.size();
  std::vector<const void*> ptrs(n);
  std::vector<Dtype> dts(n);
  for (size_t i = 0; i < n; ++i) {
    ptrs[i] = grads[i].const_data_ptr();
    dts[i] = to_dtype(grads[i].scalar_type());
  }
  const FlatLayout layout(n, [&](size_t i) { return grads[i].numel(); });
  const KernelTable& k = kernels();
  // One partial per unit, combined in unit order: the result does not depend on the thread count.
  std::vector<StatsPartial> parts(static_cast<size_t>(layout.units()), StatsPartial{0.0, 0u});
  at::parallel_for(0, layout.units(), 1, [&](int64_t ub, int64_t ue) {
    for (int64_t u = ub; u < ue; ++u) {
      StatsPartial* acc = &parts[static_cast<size_t>(u)];
      layout.for_each(u * FlatLayout::kUnit, (u + 1) * FlatLayout::kUnit, [&](size_t i, int64_t b, int64_t e) {
        const size_t es = dts[i] == Dtype::kFloat ? 4 : 2;
        k.stats(static_cast<const char*>(ptrs[i]) + b * es, dts[i], e - b, inv, acc);
      });
    }
  });
  double sum = 0;
  uint32_t mx = 0;
  for (const StatsPartial& p : parts) {
    sum += p.sumsq;
    mx = p.max_abs_bits > mx ? p.max_abs_bits : mx;
  }
  at::Tensor out = at::empty({3}, grads[0].options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  float max_abs;
  std::memcpy(&max_abs, &mx, sizeof(float));
  o[0] = static_cast<float>(sum);
  // fp32 rounding is monotonic, so max(|g| * inv) == max(|g|) * inv for inv > 0.
  o[1] = max_abs * inv;
  o[2] = mx >= 0x7f800000u ? 1.0f : 0.0f;
  return out;
}

}  // namespace cpu
}  // namespace fastops
