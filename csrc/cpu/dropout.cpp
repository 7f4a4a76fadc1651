// fastops.dropout on the CPU: one at::parallel_for over units of whole stream blocks, the per-element work in
// dropout_isa.h. The constants are fastops/_specs/dropout.py's, computed the same way.
#include <cmath>

#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "cpu/host.h"
#include "cpu/kernels.h"
#include "fastops.h"

namespace fastops {
namespace cpu {

DropoutConsts dropout_consts(double p, int64_t seed, at::ScalarType dtype) {
  DropoutConsts c{sr_key(seed, static_cast<int64_t>(static_cast<uint64_t>(seed) >> 32)), 0, 0.0f};
  if (p == 1.0) return c;
  // nearbyint rounds half to even, as Python's round() in the spec's constants.
  c.threshold = static_cast<uint32_t>(std::min(std::nearbyint(p * 4294967296.0), 4294967295.0));
  const float s = 1.0f / static_cast<float>(1.0 - p);  // torch's noise.div_(1 - p) on a mask of x's dtype
  c.scale = dtype == at::kFloat ? s : dtype == at::kBFloat16 ? float(c10::BFloat16(s)) : float(c10::Half(s));
  return c;
}

at::Tensor dropout(const DropoutArgs& a) {
  const at::Tensor& x = a.x;
  TORCH_CHECK(x.device().is_cpu(), "fastops.dropout: the C++ CPU backend takes CPU tensors, got ", x.device().str());
  at::Tensor out = at::empty_like(x);  // preserve_format: a dense x's strides, so out's memory order is x's
  const int64_t n = x.numel();
  if (n == 0) return out;
  const Dtype dt = to_dtype(x.scalar_type());
  const DropoutConsts c = dropout_consts(a.p, a.seed, x.scalar_type());
  const int64_t es = dt == Dtype::kFloat ? 4 : 2;
  const char* src = static_cast<const char*>(x.const_data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  const KernelTable& k = kernels();
  constexpr int64_t kUnit = FlatLayout::kUnit;
  at::parallel_for(0, (n + kUnit - 1) / kUnit, 1, [&](int64_t ub, int64_t ue) {
    const int64_t b = ub * kUnit, e = std::min(n, ue * kUnit);
    k.dropout(src + b * es, dst + b * es, dt, b, e - b, c.key, c.threshold, c.scale);
  });
  return out;
}

}  // namespace cpu
}  // namespace fastops
