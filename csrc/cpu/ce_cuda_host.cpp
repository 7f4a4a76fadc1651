// The CUDA row pass's per-row math (csrc/cuda/ce_math.cuh) compiled for the host, in the CUDA kernel's order: for
// each row, kCeThreads partial sums (thread tid takes logits tid, tid + kCeThreads, ...), the same merge tree, the
// loss, then each thread's gradients. Exposed as fastops._C.cuda_math.linear_cross_entropy{,_backward} (the shared
// driver around this row pass), so every CPU test run executes the CUDA kernel's arithmetic, GPU or not.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "../cuda/ce_math.cuh"
#include "../linear_ce.h"
#include "fastops.h"

namespace fastops {
namespace cuda_host {
namespace {

template <typename T>
void host_row(T* z, int64_t v, int64_t t, float c, float eps, bool with_grad, float* loss) {
  using namespace ce;
  Stats parts[kCeThreads];
  for (int tid = 0; tid < kCeThreads; ++tid) parts[tid] = stats_part(z, v, tid, kCeThreads);
  for (int stride = kCeThreads / 2; stride > 0; stride /= 2) {
    for (int tid = 0; tid < stride; ++tid) merge_step(parts, tid, stride);
  }
  const float lse = row_lse(parts[0]);
  *loss = row_loss(lse, load(z, t), parts[0].zsum, v, eps);
  if (!with_grad) return;
  for (int tid = 0; tid < kCeThreads; ++tid) grad_part(z, v, t, lse, c, eps, tid, kCeThreads);
}

template <typename T>
void host_rows(T* z, int64_t r, int64_t v, const int64_t* target, const float* row_grad, float scale, float eps,
               bool with_grad, float* loss) {
  at::parallel_for(0, r, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      // As the kernel: c = scale * row_grad[i], one fp32 multiply.
      const float c = row_grad != nullptr ? ce::ce_mul(scale, row_grad[i]) : scale;
      host_row(z + i * v, v, target[i], c, eps, with_grad, loss + i);
    }
  });
}

void rows(const at::Tensor& buf, const at::Tensor& target, const at::Tensor& row_grad, double scale, double eps,
          bool with_grad, const at::Tensor& loss) {
  if (buf.scalar_type() == at::kDouble) {
    ce_rows_aten(buf, target, row_grad, scale, eps, with_grad, loss);
    return;
  }
  const int64_t r = buf.size(0), v = buf.size(1);
  const int64_t* tp = target.const_data_ptr<int64_t>();
  const float* gp = row_grad.defined() ? row_grad.const_data_ptr<float>() : nullptr;
  float* lp = loss.data_ptr<float>();
  const float sc = float(scale), ep = float(eps);
  switch (buf.scalar_type()) {
    case at::kFloat:
      host_rows(buf.data_ptr<float>(), r, v, tp, gp, sc, ep, with_grad, lp);
      break;
    case at::kBFloat16:
      host_rows(reinterpret_cast<ce::Bf16*>(buf.data_ptr()), r, v, tp, gp, sc, ep, with_grad, lp);
      break;
    case at::kHalf:
      host_rows(reinterpret_cast<ce::F16*>(buf.data_ptr()), r, v, tp, gp, sc, ep, with_grad, lp);
      break;
    default:
      TORCH_CHECK(false, "fastops.linear_cross_entropy (cuda_host): unsupported dtype ", buf.scalar_type());
  }
}

// The CUDA binding's backend, less its matmul that accumulates in fp32 (the driver adds bf16 products instead).
const CeBackend& backend() {
  static const CeBackend b{rows, CeAccumulate(), true};
  return b;
}

}  // namespace

FASTOPS_CE_ENTRY_POINTS(backend())

}  // namespace cuda_host
}  // namespace fastops
