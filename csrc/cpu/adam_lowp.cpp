// fastops.adam_step_lowp_ on the CPU: adam.cpp's host side (step counters, bias corrections) over
// states kept as 8-bit blockwise codes or stochastically rounded bf16 (fastops/_quant.py defines both bit
// for bit); kernels_isa.h decodes, updates and re-encodes each block of 256 elements in one pass.
#include <algorithm>

#include <c10/util/Exception.h>

#include "cpu/host.h"
#include "cpu/kernels.h"
#include "cuda/codec.cuh"
#include "fastops.h"

namespace fastops {
namespace cpu {
namespace {

// The maps' fp32 constants as the CUDA kernels hold them (csrc/cuda/qmaps.cuh, generated from fastops/_quant.py),
// P, F and n padded to 8 lanes (lane 7 is never selected: the decade index is at most 6).
QuantMap map_of(bool is_signed) {
  using namespace cuda;
  QuantMap m{};
  std::copy_n(is_signed ? kSignedQmap : kUnsignedQmap, 256, m.qmap);
  std::copy_n(is_signed ? kSignedT : kUnsignedT, 8, m.T);
  std::copy_n(is_signed ? kSignedP : kUnsignedP, 7, m.P);
  std::copy_n(is_signed ? kSignedF : kUnsignedF, 7, m.F);
  for (int i = 0; i < 7; ++i) m.n[i] = is_signed ? 1 << i : 2 << i;
  m.P[7] = m.P[6];
  m.F[7] = m.F[6];
  m.n[7] = m.n[6];
  return m;
}

}  // namespace

const QuantMap& quant_map(bool is_signed) {
  static const QuantMap s = map_of(true), u = map_of(false);
  return is_signed ? s : u;
}

uint32_t sr_key(int64_t seed, int64_t index) {
  return cuda::detail::sr_key(static_cast<uint32_t>(seed), index);  // the seed's low 32 bits, as _quant.sr_key
}

void adam_step_lowp_(const AdamStepLowpArgs& a) {
  const size_t n = a.params.size();
  check_cpu(a.params, "adam_step_lowp_");
  if (n == 0 || !step_runs(a.found_inf)) return;
  const double lr = read_scalar(a.lr);
  LowpConsts c{};
  c.adam = adam_consts(a, lr);
  c.format = *state_format(a.exp_avgs);  // 8-bit or bf16: the op's check
  const bool eight_bit = c.format == StateFormat::kEightBit;

  std::vector<LowpTensor> work(n);
  for (size_t i = 0; i < n; ++i) {
    LowpTensor& w = work[i];
    adam_tensor(w, i, a, lr);
    w.exp_avg = a.exp_avgs[i].data_ptr();
    w.exp_avg_sq = a.exp_avg_sqs[i].data_ptr();
    w.exp_avg_absmax = eight_bit ? static_cast<float*>(a.exp_avg_absmax[i].data_ptr()) : nullptr;
    w.exp_avg_sq_absmax = eight_bit ? static_cast<float*>(a.exp_avg_sq_absmax[i].data_ptr()) : nullptr;
    w.sr_key = sr_key(a.seed, static_cast<int64_t>(i));
  }

  const KernelTable& k = kernels();
  // Units start on 256-element boundaries of every tensor: a block's absmax is computed by one thread.
  parallel_over(work, [&](const LowpTensor& t, int64_t b, int64_t e) { k.adam_lowp(t, c, b, e); }, 256);
}

}  // namespace cpu
}  // namespace fastops
