// fastops.adam_step_lowp_ on the CPU: adam.cpp's host side (step counters, bias corrections) over
// states kept as 8-bit blockwise codes or stochastically rounded bf16 (fastops/_quant.py defines both bit
// for bit); kernels_isa.h decodes, updates and re-encodes each block of 256 elements in one pass.
#include <cmath>

#include <c10/util/Exception.h>

#include "cpu/host.h"
#include "cpu/kernels.h"
#include "fastops.h"

namespace fastops {
namespace cpu {
namespace {

// _quant._build: the values in fp64 in the same order of operations, then rounded to fp32.
QuantMap build_map(bool is_signed) {
  QuantMap m{};
  double q[256] = {};
  double lo[7], hi[7];
  auto value = [](int i, int n, int j) { return std::pow(10.0, double(i - 6)) * (0.1 + 0.9 * (j + 0.5) / n); };
  for (int i = 0; i < 7; ++i) {
    const int n = is_signed ? 1 << i : 1 << (i + 1);
    for (int j = 0; j < n; ++j) {
      const double v = value(i, n, j);
      q[n + j] = v;
      if (is_signed) q[128 | (n + j)] = -v;
    }
    lo[i] = value(i, n, 0);
    hi[i] = value(i, n, n - 1);
    m.P[i] = static_cast<float>(std::pow(10.0, double(6 - i)));
    m.F[i] = static_cast<float>(n / 0.9);
    m.n[i] = n;
  }
  // Lane 7 of P/F/n is never selected (the decade index is at most 6).
  m.P[7] = m.P[6];
  m.F[7] = m.F[6];
  m.n[7] = m.n[6];
  if (is_signed) {
    q[0] = 0.0;
    q[128] = 1.0;
  } else {
    q[0] = 0.0;
    q[1] = 1.0;
  }
  for (int c = 0; c < 256; ++c) m.qmap[c] = static_cast<float>(q[c]);
  m.T[0] = static_cast<float>(lo[0] / 2);
  for (int i = 1; i < 7; ++i) m.T[i] = static_cast<float>((hi[i - 1] + lo[i]) / 2);
  m.T[7] = static_cast<float>((hi[6] + 1.0) / 2);
  return m;
}

uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

}  // namespace

const QuantMap& quant_map(bool is_signed) {
  static const QuantMap s = build_map(true), u = build_map(false);
  return is_signed ? s : u;
}

uint32_t sr_key(int64_t seed, int64_t index) {
  return mix32(static_cast<uint32_t>(seed) ^ mix32(static_cast<uint32_t>(index + 0x9E3779B9LL)));
}

void adam_step_lowp_(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                     const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                     const std::vector<at::Tensor>& exp_avg_absmax, const std::vector<at::Tensor>& exp_avg_sq_absmax,
                     const std::vector<at::Tensor>& state_steps, const std::vector<at::Tensor>& master_params,
                     const at::Tensor& lr, double beta1, double beta2, double eps, double weight_decay, bool maximize,
                     bool decoupled, int64_t seed, const std::optional<at::Tensor>& grad_scale,
                     const std::optional<at::Tensor>& found_inf) {
  const size_t n = params.size();
  if (n == 0) return;
  LowpConsts c{};
  double lr_v;
  if (!adam_host_setup("adam_step_lowp_", params, lr, beta1, beta2, eps, weight_decay, maximize, decoupled,
                       grad_scale, found_inf, c.adam, lr_v)) {
    return;
  }
  c.eight_bit = exp_avgs[0].scalar_type() == at::kByte;

  std::vector<LowpTensor> work(n);
  for (size_t i = 0; i < n; ++i) {
    LowpTensor& w = work[i];
    adam_tensor(w, i, params, grads, master_params, state_steps, lr_v, beta1, beta2);
    w.exp_avg = exp_avgs[i].data_ptr();
    w.exp_avg_sq = exp_avg_sqs[i].data_ptr();
    w.exp_avg_absmax = c.eight_bit ? static_cast<float*>(exp_avg_absmax[i].data_ptr()) : nullptr;
    w.exp_avg_sq_absmax = c.eight_bit ? static_cast<float*>(exp_avg_sq_absmax[i].data_ptr()) : nullptr;
    w.sr_key = sr_key(seed, static_cast<int64_t>(i));
  }

  const KernelTable& k = kernels();
  // Units start on 256-element boundaries of every tensor: a block's absmax is computed by one thread.
  parallel_over(work, [&](const LowpTensor& t, int64_t b, int64_t e) { k.adam_lowp(t, c, b, e); }, 256);
}

}  // namespace cpu
}  // namespace fastops
