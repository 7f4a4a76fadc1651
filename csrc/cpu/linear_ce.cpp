// linear_cross_entropy's chunk loop on the CPU (the semantics: fastops/_lce.py). The three matmuls of a chunk go
// through ATen (oneDNN/MKL: nothing hand-written is faster), the row pass between them is ce_isa.h's,
// vectorised for the ISA picked at load time and split over rows with at::parallel_for.
#include <algorithm>
#include <cstring>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "ce_kernels.h"
#include "fastops.h"

namespace fastops {
namespace cpu {

const CeKernels& ce_kernels() {
  static const CeKernels* const table = [] {
#ifdef FASTOPS_MULTI_ISA
    // avx512_vbmi differs from avx512 only in the 8-bit state decode; the row pass has no byte lookups.
    if (std::strncmp(kernels().name, "avx512", 6) == 0) return &kCe_isa_avx512;
    if (std::strcmp(kernels().name, "avx2") == 0) return &kCe_isa_avx2;
#endif
    return &kCe_isa_default;
  }();
  return *table;
}

namespace {
// Logit elements per chunk when chunk_rows <= 0; fastops/_lce.py passes its CHUNK_ELEMENTS / V (measured there).
constexpr int64_t kChunkElements = int64_t(1) << 20;
// Rows of grad_weight per bf16/fp16 partial product: there is no mixed-dtype matmul on the CPU, so a chunk's
// product is made in the inputs' dtype and added to the fp32 accumulator a block at a time (a 4 MiB temporary at
// H = 256, not one of V x H).
constexpr int64_t kVocabBlock = 8192;
}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_ce_pass(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias, const at::Tensor& target,
    double label_smoothing, double scale, const std::optional<at::Tensor>& grad_rows, bool with_grad,
    int64_t chunk_rows) {
  constexpr const char* op = "fastops.linear_cross_entropy";
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), op,
              ": x must be (M, H) and weight (V, H); got x ", x.sizes(), ", weight ", weight.sizes());
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && target.device().is_cpu(), op,
              ": the cpp backend takes CPU tensors");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), op, ": weight has dtype ", weight.scalar_type(),
              " but x has ", x.scalar_type());
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op, ": x has dtype ", dtype,
              "; the cpp backend takes float32, bfloat16 or float16");
  const int64_t m = x.size(0), h = x.size(1), v = weight.size(0);
  TORCH_CHECK(target.scalar_type() == at::kLong && target.dim() == 1 && target.size(0) == m, op,
              ": target must be int64 of shape (", m, ")");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == dtype && bias->dim() == 1 && bias->size(0) == v && bias->device().is_cpu(),
                op, ": bias must be (", v, ") of x's dtype on the CPU");
  }
  at::Tensor grow;
  if (grad_rows.has_value()) {
    TORCH_CHECK(grad_rows->numel() == m, op, ": grad_rows has ", grad_rows->numel(), " elements, expected ", m);
    grow = grad_rows->to(at::kFloat).contiguous();
  }
  const at::Tensor xc = x.contiguous(), w = weight.contiguous(), tgt = target.contiguous();
  const at::Tensor wt = w.t();
  const bool native = dtype == at::kFloat || dtype == at::kBFloat16;  // fp16 rows go through fp32
  const at::TensorOptions f32 = x.options().dtype(at::kFloat);
  at::Tensor loss = at::empty({m}, f32);
  at::Tensor gx = with_grad ? at::empty({m, h}, x.options()) : at::empty({0}, x.options());
  at::Tensor gw = with_grad ? at::zeros({v, h}, f32) : at::empty({0}, f32);
  at::Tensor gb = with_grad && bias.has_value() ? at::zeros({v}, f32) : at::empty({0}, f32);
  const int64_t rows = chunk_rows > 0 ? chunk_rows : std::max<int64_t>(1, kChunkElements / std::max<int64_t>(v, 1));
  const CeKernels& k = ce_kernels();
  const int64_t* tp = tgt.data_ptr<int64_t>();
  const float* gp = grow.defined() ? grow.data_ptr<float>() : nullptr;
  float* lp = loss.data_ptr<float>();
  const float eps = float(label_smoothing), sc = float(scale);
  for (int64_t s = 0; s < m; s += rows) {
    const int64_t r = std::min(rows, m - s);
    const at::Tensor xs = xc.narrow(0, s, r);
    at::Tensor logits = bias.has_value() ? at::addmm(*bias, xs, wt) : at::mm(xs, wt);
    at::Tensor buf = native ? logits : logits.to(at::kFloat);
    const Dtype dt = buf.scalar_type() == at::kFloat ? Dtype::kFloat : Dtype::kBFloat16;
    void* base = buf.data_ptr();
    // A row of 32k logits is ~30 us of row pass: a task of at least 32k elements amortises a thread's wake-up.
    const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(v, 1));
    at::parallel_for(0, r, grain, [&](int64_t b, int64_t e) {
      k.rows(base, dt, v, tp + s, gp != nullptr ? gp + s : nullptr, sc, eps, with_grad, lp + s, b, e);
    });
    if (!with_grad) continue;
    const at::Tensor dl = native ? buf : buf.to(dtype);
    at::Tensor gxs = gx.narrow(0, s, r);
    at::mm_out(gxs, dl, w);
    if (dtype == at::kFloat) {
      gw.addmm_(dl.t(), xs);
    } else {
      for (int64_t v0 = 0; v0 < v; v0 += kVocabBlock) {
        const int64_t vb = std::min(kVocabBlock, v - v0);
        gw.narrow(0, v0, vb).add_(at::mm(dl.narrow(1, v0, vb).t(), xs));
      }
    }
    if (bias.has_value()) gb.add_(at::sum(buf, {0}, false, at::kFloat));
  }
  if (with_grad && dtype != at::kFloat) {
    gw = gw.to(dtype);
    gb = gb.to(dtype);
  }
  return {loss, gx, gw, gb};
}

}  // namespace cpu
}  // namespace fastops
