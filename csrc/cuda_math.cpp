// The CUDA kernels' math on the CPU (fastops._C.cuda_math): csrc/cuda/adam_math.cuh and codec.cuh, the Adam update,
// its step scalars, the 8-bit codec and the stochastic rounding, compiled for the host (csrc/cuda/host_device.h)
// and run on CPU tensors as the kernels run them. Every build compiles it, CUDA or not, and tests/test_cuda_math.py
// holds its results to the reference and to the C++ CPU kernels, bit for bit.
//
// Each op is set up as the CUDA binding sets it up (csrc/cuda/host.h: where each scalar is read, the step counters,
// the launch scalars, the per-tensor table and its chunk list) with the CPU as the tensors' device, so the scalars
// take the kernels' pointer path. Then every chunk of the table is walked as one block of the kernel walks it:
// detail::launch_scalars and chunk_at give its step scalars, and each element goes through the kernel's own per-element
// functions (adam_math, decode, encode, sr_block_key, sr_bits, round_bf16_sr), one after another where the kernel has a thread per
// element (the kernels' 4-wide loads feed adam_math the same values).
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "cuda/adam_math.cuh"
#include "cuda/codec.cuh"
#include "cuda/dropout_math.cuh"
#include "cuda/host.h"
#include "fastops.h"
#include "generated/op_bindings.h"

namespace fastops {
namespace cuda {
namespace {

constexpr int64_t kQBlock = 256;

template <class T>
T* at_address(int64_t address) {
  return reinterpret_cast<T*>(static_cast<intptr_t>(address));
}

// run(T{}) with T the storage type of the params of one dtype group: float, c10::BFloat16 or c10::Half, whose
// conversions to and from fp32 round to nearest even as the kernels' Elem<T> does.
template <class Run>
void for_storage(at::ScalarType dtype, const Run& run) {
  if (dtype == at::kBFloat16) {
    run(c10::BFloat16{});
  } else if (dtype == at::kHalf) {
    run(c10::Half{});
  } else {
    run(0.0f);
  }
}

// The binding's launch_adam, with a host table and `walk(T{}, k)` in place of the launch.
template <class KernelArgs, class OpArgs, class Own, class Walk>
void run_adam(KernelArgs k, const OpArgs& a, const Own& own, const Walk& walk) {
  TORCH_CHECK(a.params.empty() || a.params[0].is_cpu(), "fastops._C.cuda_math takes CPU tensors");
  if (a.params.empty()) return;
  const LaunchScalars sc = launch_scalars(a, a.params[0].device());
  if (sc.skip) return;
  bump_steps(a.state_steps, sc);
  set_adam_scalars(k, a, sc);
  if (k.found_inf != nullptr && *k.found_inf != 0.0f) return;  // the kernels' first line
  for (const auto& group : group_by_dtype(a.params)) {
    const std::vector<int64_t> rows = adam_rows(a, group.second, own);
    const std::vector<int64_t> chunks = chunk_list(rows, static_cast<int64_t>(rows.size() / group.second.size()));
    k.tensors = rows.data();
    k.chunks = chunks.data();
    k.n_chunks = static_cast<int64_t>(chunks.size() / 2);
    for_storage(group.first, [&](auto t) { walk(t, k); });
  }
}

// The param and grad of an Adam table row as the kernels read and write them: through the fp32 master where there is
// one.
template <class T>
struct ParamRow {
  T* param;
  const T* grad;
  float* master;
  explicit ParamRow(const int64_t* row)
      : param(at_address<T>(row[kAdamParam])),
        grad(at_address<const T>(row[kAdamGrad])),
        master(at_address<float>(row[kAdamMaster])) {}
  float load(int64_t i) const { return master != nullptr ? master[i] : static_cast<float>(param[i]); }
  float load_grad(int64_t i) const { return static_cast<float>(grad[i]); }
  void store(int64_t i, float x) const {
    if (master != nullptr) master[i] = x;
    param[i] = T(x);
  }
};

// body(chunk, step scalars) for every chunk of the table, as the kernel's blocks take them.
template <int kCols, class Args, class Body>
void for_each_chunk(const Args& a, const Body& body) {
  detail::StepScalars s;
  const float lr = detail::launch_scalars(a, s);
  for (int64_t c = 0; c < a.n_chunks; ++c) body(detail::chunk_at<kCols>(a, c, lr, s), s);
}

// adam.cu's adam_kernel, element by element.
template <class T>
void walk_adam(const AdamArgs& a) {
  for_each_chunk<kAdamCols>(a, [&](const detail::Chunk& ch, const detail::StepScalars& s) {
    const ParamRow<T> t(ch.row);
    float* m = at_address<float>(ch.row[kAdamExpAvg]);
    float* v = at_address<float>(ch.row[kAdamExpAvgSq]);
    float* vmax = at_address<float>(ch.row[kAdamMaxExpAvgSq]);
    for (int64_t i = ch.start; i < ch.end; ++i) {
      float x = t.load(i), unused = 0.0f;
      if (a.amsgrad) {
        detail::adam_math<true>(x, t.load_grad(i), m[i], v[i], vmax[i], a, s);
      } else {
        detail::adam_math<false>(x, t.load_grad(i), m[i], v[i], unused, a, s);
      }
      t.store(i, x);
    }
  });
}

// adam_lowp.cu's adam_lowp_kernel: a warp's 256-element block at a time, its absmax over the block (the warp's
// reduction), the codes after it.
template <class T>
void walk_lowp(const AdamLowpArgs& a) {
  const bool eight_bit = a.format == StateFormat::kEightBit;
  for_each_chunk<kLowpCols>(a, [&](const detail::Chunk& ch, const detail::StepScalars& s) {
    const ParamRow<T> t(ch.row);
    float* m_absmax = at_address<float>(ch.row[kLowpExpAvgAbsmax]);
    float* v_absmax = at_address<float>(ch.row[kLowpExpAvgSqAbsmax]);
    uint8_t* m_codes = at_address<uint8_t>(ch.row[kAdamExpAvg]);
    uint8_t* v_codes = at_address<uint8_t>(ch.row[kAdamExpAvgSq]);
    c10::BFloat16* m_bf16 = at_address<c10::BFloat16>(ch.row[kAdamExpAvg]);
    c10::BFloat16* v_bf16 = at_address<c10::BFloat16>(ch.row[kAdamExpAvgSq]);
    const uint32_t key = detail::sr_key(a.seed, ch.row[kLowpIndex]);
    for (int64_t b0 = ch.start; b0 < ch.end; b0 += kQBlock) {
      const int64_t blk = b0 / kQBlock, n = std::min(kQBlock, ch.end - b0);
      const uint32_t kb = eight_bit ? 0u : detail::sr_block_key(key, blk);
      float m[kQBlock] = {}, v[kQBlock] = {};  // past the end: 0, which raises no absmax (as the kernel's lanes)
      for (int64_t k = 0; k < n; ++k) {
        const int64_t i = b0 + k;
        m[k] = eight_bit ? detail::decode<true>(m_codes[i], m_absmax[blk]) : static_cast<float>(m_bf16[i]);
        v[k] = eight_bit ? detail::decode<false>(v_codes[i], v_absmax[blk]) : static_cast<float>(v_bf16[i]);
        float x = t.load(i), unused = 0.0f;
        if (eight_bit) detail::adam_math<false>(x, t.load_grad(i), m[k], v[k], unused, a, s);
        else detail::adam_math<false, true>(x, t.load_grad(i), m[k], v[k], unused, a, s);
        t.store(i, x);
        if (!eight_bit) {
          const uint32_t bits = detail::sr_bits(kb, static_cast<uint32_t>(k));
          m_bf16[i] = c10::BFloat16(detail::round_bf16_sr(m[k], bits & 0xFFFFu), c10::BFloat16::from_bits());
          v_bf16[i] = c10::BFloat16(detail::round_bf16_sr(v[k], bits >> 16), c10::BFloat16::from_bits());
        }
      }
      if (!eight_bit) continue;
      float m_max = 0.0f, v_max = 0.0f;
      for (int64_t k = 0; k < kQBlock; ++k) {
        m_max = detail::max_nan(m_max, fabsf(m[k]));
        v_max = detail::max_nan(v_max, v[k]);
      }
      m_absmax[blk] = m_max;
      v_absmax[blk] = v_max;
      for (int64_t k = 0; k < n; ++k) {
        m_codes[b0 + k] = detail::encode<true>(detail::__fdiv_rn(m[k], m_max));
        v_codes[b0 + k] = detail::encode<false>(detail::__fdiv_rn(v[k], v_max));
      }
    }
  });
}

}  // namespace

// dropout with dropout.cu's per-element math, one element at a time (dropout_math.cuh).
at::Tensor dropout_host(const DropoutArgs& a) {
  at::Tensor out = at::empty_like(a.x);
  const cpu::DropoutConsts c = cpu::dropout_consts(a.p, a.seed, a.x.scalar_type());
  const at::Tensor x = a.x.to(at::kFloat), y = at::empty_like(x);
  const float* xs = x.const_data_ptr<float>();
  float* ys = y.mutable_data_ptr<float>();
  for (int64_t k = 0; k < x.numel(); ++k) ys[k] = xs[k] * detail::dropout_factor(c.key, k, c.threshold, c.scale);
  return out.copy_(y);
}

void register_cuda_math(pybind11::module_ m) {
  def_adam_step_(m, [](const AdamStepArgs& a) {
    AdamArgs k{};
    k.amsgrad = a.amsgrad;
    run_adam(k, a, adam_own(a), [](auto t, const AdamArgs& k) { walk_adam<decltype(t)>(k); });
  });
  def_adam_step_lowp_(m, [](const AdamStepLowpArgs& a) {
    if (a.params.empty()) return;
    const AdamLowpArgs k = lowp_args(a);
    run_adam(k, a, lowp_own(a, k.format == StateFormat::kEightBit),
             [](auto t, const AdamLowpArgs& k) { walk_lowp<decltype(t)>(k); });
  });
  def_dropout(m, dropout_host);
}

}  // namespace cuda
}  // namespace fastops
