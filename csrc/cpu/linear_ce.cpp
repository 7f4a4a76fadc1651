// linear_cross_entropy: the driver every C++ backend shares (csrc/linear_ce.h) and the CPU backend's row pass
// (ce_isa.h, vectorised for the ISA picked at load time, split over rows with at::parallel_for). The matmuls go
// through ATen (oneDNN/MKL). Where partial products add up in fp32 (chunks of rows' grad_weight, the vocabulary
// blocks' grad_x), MKL's bf16 x bf16 -> fp32 GEMM on Intel CPUs, fastops' own (gemm_bf16.cpp) on other CPUs with
// AVX-512 BF16, oneDNN's fp32 one on the rest with AVX-512 (ce_accumulate()).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <tuple>

#include <sys/mman.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "../linear_ce.h"
#include "ce_kernels.h"
#include "cpu/gemm_bf16.h"
#include "fastops.h"

// MKL's mixed-precision GEMM (C = alpha op(A) op(B) + beta C, A and B bf16, C fp32), which torch's x86 builds link
// in and export. Weak: a torch without it leaves the pointer null, and the driver adds bf16 products instead.
extern "C" void cblas_gemm_bf16bf16f32(int layout, int transa, int transb, int m, int n, int k, float alpha,
                                       const uint16_t* a, int lda, const uint16_t* b, int ldb, float beta, float* c,
                                       int ldc) __attribute__((weak));

// ATen's oneDNN matmul (result = beta result + alpha mat1 @ mat2, all three of one dtype), exported by torch's x86
// builds but declared in a header they do not ship. Weak: a torch without it (or with another signature) leaves it
// null, and ce_accumulate() does not pick it.
namespace at::native {
void mkldnn_matmul(const at::Tensor& mat1, const at::Tensor& mat2, const at::Tensor& result, float beta, float alpha)
    __attribute__((weak));
}  // namespace at::native

namespace fastops {

namespace {
constexpr char kOp[] = "fastops.linear_cross_entropy";
// Rows of grad_weight per bf16/fp16 partial product where no fp32-accumulating matmul serves: a 4 MiB temporary
// at H = 256 rather than one of V x H.
constexpr int64_t kVocabBlock = 8192;
}  // namespace

// See linear_ce.h. The caps are fastops/_lce.py's CHUNK_ROWS and FROZEN_CHUNK_ROWS (measured there).
int64_t ce_chunk_rows(int64_t m, int64_t h, int64_t v, int64_t itemsize, bool grad_weight) {
  const int64_t cap = grad_weight ? 512 : 256;
  if (m <= cap) return std::max<int64_t>(m, 1);
  const int64_t row_bytes = std::max<int64_t>(v, 1) * itemsize;
  // Several chunks of bf16/fp16 add grad_weight up in an fp32 accumulator of 4VH bytes (fp32 grads are their own):
  // chunk only where that and one chunk hold at most half of the whole batch's logits.
  const int64_t acc = grad_weight && itemsize < 4 ? 4 * v * h : 0;
  if (2 * (acc + cap * row_bytes) > m * row_bytes) return m;
  const int64_t chunks = (m + cap - 1) / cap;
  return (m + chunks - 1) / chunks;  // chunks of equal size: no short last one
}

// See linear_ce.h and fastops/_lce.py's vocab_block(), the same function, where the rule's numbers are measured.
int64_t ce_vocab_block(int64_t m, int64_t h, int64_t v, int64_t itemsize, bool grad_weight) {
  constexpr int64_t kMaxHidden = 256, kBlockElems = int64_t(1) << 20, kMinCols = 256, kMaxCols = 4096;
  if (!grad_weight || itemsize != 2 || h > kMaxHidden || m < 1) return 0;
  const int64_t rows = ce_chunk_rows(m, h, v, itemsize, true);
  // What chunks of rows hold: their logits, the fp32 accumulator where there are several, the weight's copy.
  const int64_t held = rows * v * itemsize + (rows < m ? 4 * v * h : 0) + (m >= 4 * h ? 2 * v * h : 0);
  if (8 * held <= 3 * m * v * itemsize) return 0;
  const int64_t cols = std::clamp<int64_t>(std::min(kBlockElems / m, v / 16) / 64 * 64, kMinCols, kMaxCols);
  return cols < v ? cols : 0;
}

void ce_rows_aten(const at::Tensor& buf, const at::Tensor& target, const at::Tensor& row_grad, double scale,
                  double eps, bool with_grad, const at::Tensor& loss) {
  const int64_t v = buf.size(1);
  const at::Tensor z = buf;
  const at::Tensor lse = at::logsumexp(z, {1});
  const at::Tensor zt = z.gather(1, target.unsqueeze(1)).squeeze(1);
  // In log-probabilities, as torch: (1 - eps)(lse - z_t) + eps (lse - mean z), exactly 0 at V = 1.
  at::Tensor l = (lse - zt) * (1 - eps);
  if (eps != 0) l = l + (lse - z.sum(1) / double(v)) * eps;
  loss.copy_(l);
  if (!with_grad) return;
  at::Tensor g = at::exp(z - lse.unsqueeze(1));
  if (eps != 0) g.sub_(eps / double(v));
  g.scatter_add_(1, target.unsqueeze(1), at::full({z.size(0), 1}, -(1 - eps), z.options()));
  at::Tensor c = row_grad.defined() ? row_grad.to(z.scalar_type()) * scale : at::full({z.size(0)}, scale, z.options());
  buf.copy_(g * c.unsqueeze(1));
}

namespace {

// A CPU buffer of the driver's own (the chunk of logits, the fp32 accumulator) on transparent huge pages where
// the kernel allows them (madvise mode, the common default): glibc maps a block this large afresh at every call,
// and on 4 KiB pages the first touch costs a fault each. Measured on the 2-core Xeon VM: 64 MiB first touched in
// 45-47 ms on 4 KiB pages, 21-31 ms on huge pages, 11-18 ms once touched. Where fastops' CPU cache is torch's
// allocator (fastops.accelerate installs it) the blocks come from there, touched already: the bf16 forward +
// backward at N 1024, H 256, V 32000 took 100 ms (median; 1 thread, CPU time) with it against 102-110 ms, and
// 52-55 ms against 55-60 ms at 2 threads. Elsewhere (GPU, small) at::empty.
at::Tensor workspace(at::IntArrayRef sizes, const at::TensorOptions& opts) {
  constexpr size_t kHuge = size_t(2) << 20;
  int64_t numel = 1;
  for (const int64_t d : sizes) numel *= d;
  const size_t bytes = size_t(numel) * at::elementSize(opts.dtype().toScalarType());
  if (!opts.device().is_cpu() || bytes < 2 * kHuge || cpu::cpu_cache_active()) return at::empty(sizes, opts);
  const size_t size = (bytes + kHuge - 1) / kHuge * kHuge;
  void* p = nullptr;
  if (posix_memalign(&p, kHuge, size) != 0) return at::empty(sizes, opts);
  madvise(p, size, MADV_HUGEPAGE);  // advice only: on failure the pages are 4 KiB ones
  return at::from_blob(p, sizes, [](void* q) { std::free(q); }, opts);
}

// dst (fp32) = a @ b (+ dst unless first) through a product in a's dtype: where the backend has no matmul that sums
// a low-precision product into fp32 (CeAccumulate). Each partial is rounded to a's dtype before the fp32 sum.
void add_product(const at::Tensor& dst, const at::Tensor& a, const at::Tensor& b, bool first) {
  const at::Tensor part = at::mm(a, b);
  if (first) {
    dst.copy_(part);
  } else {
    dst.add_(part);
  }
}

// ce_pass through the vocabulary in blocks of `cols` columns (bf16, grad_weight wanted; ce_vocab_block): every
// labeled row's logits of one block at a time, twice. The first pass folds them into each row's log-sum-exp; the
// second overwrites them by their gradient and turns that into the block's rows of grad_weight, one matmul over all
// rows (summed in fp32 and rounded once, as torch's: no V x H accumulator), and its share of grad_x, summed over the
// blocks in an fp32 m x H accumulator inside the backend's mixed-precision matmul. It holds m x cols logits.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> ce_pass_blocks(
    const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, const at::Tensor& target,
    const at::Tensor& row_grad, double scale, double eps, bool want_gx, bool want_gb, int64_t cols,
    const CeBackend& backend) {
  const int64_t m = x.size(0), h = x.size(1), v = w.size(0);
  const at::TensorOptions f32 = x.options().dtype(at::kFloat);
  const at::Tensor flat = workspace({m * cols}, x.options());
  // fp32 master weights are cast a block at a time (twice: once per pass), never whole: a whole cast would hold
  // 2VH bytes more during the call, and the cache would keep them resident after it.
  const bool master = w.scalar_type() != x.scalar_type();
  const auto in_x_dtype = [&](const at::Tensor& t) { return master ? t.to(x.scalar_type()) : t; };
  const auto logits = [&](int64_t v0, int64_t n, const at::Tensor& wb) {
    at::Tensor z = flat.narrow(0, 0, m * n).view({m, n});
    if (bias.has_value()) {
      at::addmm_out(z, in_x_dtype(bias->narrow(0, v0, n)), x, wb.t());
    } else {
      at::mm_out(z, x, wb.t());
    }
    return z;
  };
  const at::Tensor mx = at::full({m}, -std::numeric_limits<float>::infinity(), f32);
  const at::Tensor s = at::zeros({m}, f32), zs = at::zeros({m}, f32), zt = at::zeros({m}, f32);
  for (int64_t v0 = 0; v0 < v; v0 += cols) {
    const int64_t n = std::min(cols, v - v0);
    backend.block_stats(logits(v0, n, in_x_dtype(w.narrow(0, v0, n))), v0, target, mx, s, zs, zt);
  }
  const at::Tensor lse = mx + s.log();
  at::Tensor loss = (lse - zt) * (1 - eps);  // as the row pass: in log-probabilities, exactly 0 at V = 1
  if (eps != 0) loss = loss + (lse - zs / double(v)) * eps;
  const at::Tensor gw = at::empty({v, h}, w.options());
  const at::Tensor gxa = want_gx ? at::empty({m, h}, f32) : at::Tensor();
  const at::Tensor gb = want_gb ? at::empty({v}, f32) : at::Tensor();
  // Backwards through the blocks: the first pass left the last block's logits in `flat` (block_stats only reads
  // them), so one block in v / cols skips its logits' second matmul at no memory cost.
  const int64_t last = (v - 1) / cols * cols;
  for (int64_t v0 = last; v0 >= 0; v0 -= cols) {
    const int64_t n = std::min(cols, v - v0);
    const at::Tensor wb = in_x_dtype(w.narrow(0, v0, n));
    const at::Tensor z = v0 == last ? flat.narrow(0, 0, m * n).view({m, n}) : logits(v0, n, wb);
    backend.block_grad(z, v0, v, target, row_grad, scale, eps, lse);
    at::Tensor gws = gw.narrow(0, v0, n);
    if (master) {
      add_product(gws, z.t(), x, true);  // the same bf16 matmul, its block widened while in cache
    } else {
      at::mm_out(gws, z.t(), x);
    }
    if (want_gx) {
      const bool first = v0 == last;
      if (!backend.accumulate || !backend.accumulate(gxa, z, wb, first)) add_product(gxa, z, wb, first);
    }
    if (want_gb) gb.narrow(0, v0, n).copy_(at::sum(z, {0}, false, at::kFloat));
  }
  const at::Tensor none = at::empty({0}, x.options());
  return {loss, want_gx ? gxa.to(x.scalar_type()) : none, gw,
          want_gb ? gb.to(w.scalar_type()) : at::empty({0}, w.options())};
}

// The pass over labeled rows: per-row losses (fp32 or fp64) and the asked-for gradients of
// sum_rows loss * scale * row_grad (grad_weight and grad_bias in the params' dtype: fp32 master weights under
// bf16/fp16 x get them unrounded, with the matmuls in x's dtype).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> ce_pass(
    const at::Tensor& x, const at::Tensor& w_param, const std::optional<at::Tensor>& bias_param,
    const at::Tensor& target, const at::Tensor& row_grad, double scale, double eps, bool want_gx, bool want_gw,
    bool want_gb, int64_t chunk_rows, const CeBackend& backend) {
  const int64_t m = x.size(0), h = x.size(1), v = w_param.size(0);
  const at::ScalarType dtype = x.scalar_type();
  const at::ScalarType out_t = w_param.scalar_type();
  const bool widen = dtype == at::kHalf && !backend.rows_take_half;
  const at::ScalarType acc_t = dtype == at::kDouble ? at::kDouble : at::kFloat;
  const at::TensorOptions acc_opts = x.options().dtype(acc_t);
  const bool with_grad = want_gx || want_gw || want_gb;
  if (chunk_rows <= 0 && dtype == at::kBFloat16 && backend.block_stats && backend.block_grad) {
    const int64_t cols = ce_vocab_block(m, h, v, at::elementSize(dtype), want_gw);
    if (cols > 0) {
      return ce_pass_blocks(x, w_param, bias_param, target, row_grad, scale, eps, want_gx, want_gb, cols, backend);
    }
  }
  const at::Tensor w = w_param.to(dtype);
  const std::optional<at::Tensor> bias =
      bias_param.has_value() ? std::optional<at::Tensor>(bias_param->to(dtype)) : bias_param;
  const int64_t rows = std::min(
      m, chunk_rows > 0 ? chunk_rows : ce_chunk_rows(m, h, v, at::elementSize(dtype), want_gw));
  const bool one_chunk = rows >= m;
  const bool native_acc = dtype == at::kFloat || dtype == at::kDouble;

  at::Tensor loss = at::empty({m}, acc_opts);
  at::Tensor gx = want_gx ? at::empty({m, h}, x.options()) : at::empty({0}, x.options());
  at::Tensor gw;  // one chunk: the matmul's own output; else the fp32 accumulator (params' dtype for fp32/fp64)
  at::Tensor gb = want_gb ? at::zeros({v}, acc_opts) : at::Tensor();
  at::Tensor logits = workspace({rows, v}, x.options());
  at::Tensor wide = widen ? workspace({rows, v}, acc_opts) : at::Tensor();
  // The logits' matmul reads the weight as H x V: on the CPU a contiguous copy of it runs that matmul faster than
  // the transposed view, which pays where there are many rows per hidden unit. Measured (Xeon with AMX, 1 thread,
  // bf16, forward + backward, the copy included): N/H = 4 and 16 at H = 256 0.90x the time, N/H = 4 at H = 1024
  // 0.95x, N/H = 2 1.01x, N/H = 1 1.16x. It holds 2VH more bytes during the call. A frozen head's chunks of 256
  // rows gain nothing from it (N = 1024, H = 256, 1 thread, the time without it: 0.92x at V = 128256 pinned,
  // 1.00x at V = 32000), and its 2VH bytes would be as much again as their logits. Without AMX oneDNN reads the
  // transposed view as fast as the copy, which then only costs: on the AMD Zen 5 (2 threads, best of 5),
  // 4096 x 1024 @ 1024 x 32000 took 457 ms from the view, 456 from a copy and 514 with the copy made; the whole op
  // at N 4096, H 1024, V 32000 took 1242-1331 ms with the copy, 1171-1259 without (N 4095 alternating with 4096).
  // The chunk plans (ce_chunk_rows, ce_vocab_block) count the copy wherever it may be made.
  at::Tensor wt = w.t();
  if (x.device().is_cpu() && want_gw && m >= 4 * h && __builtin_cpu_supports("amx-bf16")) {
    at::Tensor copy = workspace({h, v}, w.options());
    copy.copy_(wt);
    wt = copy;
  }
  for (int64_t s = 0; s < m; s += rows) {
    const int64_t r = std::min(rows, m - s);
    const bool first = s == 0;
    const at::Tensor xs = x.narrow(0, s, r);
    at::Tensor z = logits.narrow(0, 0, r);
    if (bias.has_value()) {
      at::addmm_out(z, *bias, xs, wt);
    } else {
      at::mm_out(z, xs, wt);
    }
    at::Tensor buf = z;
    if (widen) {
      buf = wide.narrow(0, 0, r);
      buf.copy_(z);
    }
    backend.rows(buf, target.narrow(0, s, r), row_grad.defined() ? row_grad.narrow(0, s, r) : row_grad, scale, eps,
                 with_grad, loss.narrow(0, s, r));
    if (!with_grad) continue;
    if (widen) z.copy_(buf);
    const at::Tensor& dl = z;
    if (want_gx) {
      at::Tensor gxs = gx.narrow(0, s, r);
      at::mm_out(gxs, dl, w);
    }
    if (want_gw) {
      if (one_chunk) {
        gw = at::mm(dl.t(), xs);  // summed in fp32 inside the matmul and rounded once, as torch's own
      } else if (native_acc) {
        if (first) {
          gw = at::mm(dl.t(), xs);
        } else {
          gw.addmm_(dl.t(), xs);
        }
      } else {
        // Where the weight is fp32 (a master weight) the accumulator is the grad_weight returned, which becomes
        // .grad: a tensor of torch's allocator, not a workspace() block (from_blob storage is not resizable).
        if (first) gw = out_t == at::kFloat ? at::empty({v, h}, acc_opts) : workspace({v, h}, acc_opts);
        if (!backend.accumulate || !backend.accumulate(gw, dl.t(), xs, first)) {
          for (int64_t v0 = 0; v0 < v; v0 += kVocabBlock) {
            const int64_t vb = std::min(kVocabBlock, v - v0);
            add_product(gw.narrow(0, v0, vb), dl.narrow(1, v0, vb).t(), xs, first);
          }
        }
      }
    }
    if (want_gb) gb.add_(at::sum(buf, {0}, false, acc_t));
  }
  if (!want_gw) {
    gw = at::empty({0}, w_param.options());
  } else if (gw.scalar_type() != out_t) {
    gw = gw.to(out_t);
  }
  gb = want_gb ? gb.to(out_t) : at::empty({0}, w_param.options());
  return {loss, gx, gw, gb};
}

struct Labeled {
  at::Tensor idx;  // undefined when every row has a label
  at::Tensor x, target;
};

// The labeled rows of x (n x H) and their int64 targets; a target outside [0, V) raises as torch's IndexError.
Labeled labeled_rows(const at::Tensor& x2, const at::Tensor& t1, int64_t ignore_index, int64_t v) {
  int64_t n_labeled = 0, bad = 0;
  bool has_bad = false;
  if (t1.device().is_cpu()) {
    const at::Tensor t = t1.to(at::kLong).contiguous();
    const int64_t* p = t.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < t.numel(); ++i) {
      if (p[i] == ignore_index) continue;
      ++n_labeled;
      if (!has_bad && (p[i] < 0 || p[i] >= v)) {
        has_bad = true;
        bad = p[i];
      }
    }
  } else {
    const at::Tensor keep = t1.ne(ignore_index);
    const at::Tensor out = keep.logical_and(t1.lt(0).logical_or(t1.ge(v)));
    n_labeled = keep.sum().item<int64_t>();
    if (out.any().item<bool>()) {
      has_bad = true;
      bad = t1.masked_select(out)[0].item<int64_t>();
    }
  }
  TORCH_CHECK_INDEX(!has_bad, kOp, ": Target ", bad, " is out of bounds (vocabulary ", v, ").");
  if (n_labeled == t1.numel()) return {at::Tensor(), x2.contiguous(), t1.to(at::kLong).contiguous()};
  const at::Tensor idx = t1.ne(ignore_index).nonzero().squeeze(1);
  return {idx, x2.index_select(0, idx), t1.index_select(0, idx).to(at::kLong)};
}

at::ScalarType loss_dtype(const at::Tensor& x) { return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

}  // namespace

CeForward ce_forward(FASTOPS_CE_PARAMS, const CeBackend& backend) {
  const int64_t h = x.size(-1), v = weight.size(0);
  const at::Tensor x2 = x.reshape({-1, h}), t1 = target.reshape({-1});
  const int64_t n = x2.size(0);
  const bool none = reduction == kCeNone;
  grad_x = grad_x && !none;
  grad_weight = grad_weight && !none;
  grad_bias = grad_bias && !none && bias.has_value();
  const Labeled l = labeled_rows(x2, t1, ignore_index, v);
  const int64_t m = l.x.size(0);
  const double denom = reduction == kCeMean ? (normalizer > 0 ? normalizer : double(m)) : 1.0;
  const at::TensorOptions lopts = x.options().dtype(loss_dtype(x));
  at::Tensor loss_rows, gxl, gw, gb;
  if (m > 0) {
    const std::optional<at::Tensor> b = bias.has_value() ? std::optional<at::Tensor>(bias->contiguous()) : bias;
    std::tie(loss_rows, gxl, gw, gb) = ce_pass(l.x, weight.contiguous(), b, l.target, at::Tensor(), 1.0 / denom,
                                               label_smoothing, grad_x, grad_weight, grad_bias, chunk_rows, backend);
  } else {
    loss_rows = at::zeros({0}, lopts);
    gxl = at::zeros({0, h}, x.options());
    gw = grad_weight ? at::zeros_like(weight) : at::empty({0}, weight.options());
    gb = grad_bias ? at::zeros({v}, weight.options()) : at::empty({0}, weight.options());
  }
  at::Tensor loss;
  if (none) {
    loss = l.idx.defined() ? at::zeros({n}, lopts).index_copy_(0, l.idx, loss_rows) : loss_rows;
    loss = loss.reshape(target.sizes());
  } else {
    loss = loss_rows.sum() / denom;  // a mean over no labeled row: 0 / 0 = nan, as torch's
  }
  at::Tensor gx = at::empty({0}, x.options());
  if (grad_x) {
    gx = l.idx.defined() ? at::zeros({n, h}, x.options()).index_copy_(0, l.idx, gxl) : gxl;
    gx = gx.reshape(x.sizes());
  }
  return {loss, gx, gw, gb};
}

CeBackward ce_backward(const at::Tensor& grad_loss, FASTOPS_CE_PARAMS, const CeBackend& backend) {
  const int64_t h = x.size(-1), v = weight.size(0);
  const at::Tensor x2 = x.reshape({-1, h}), t1 = target.reshape({-1});
  grad_bias = grad_bias && bias.has_value();
  const Labeled l = labeled_rows(x2, t1, ignore_index, v);
  const int64_t m = l.x.size(0);
  at::Tensor gxl, gw, gb;
  if (m > 0) {
    // The incoming gradient stays on its device (no host read): one factor per row.
    at::Tensor row_grad;
    if (reduction == kCeNone) {
      const at::Tensor g = grad_loss.reshape({-1}).to(loss_dtype(x));
      row_grad = (l.idx.defined() ? g.index_select(0, l.idx) : g).contiguous();
    } else {
      const double denom = reduction == kCeMean ? (normalizer > 0 ? normalizer : double(m)) : 1.0;
      row_grad = (grad_loss.to(loss_dtype(x)).reshape({1}) / denom).expand({m}).contiguous();
    }
    const std::optional<at::Tensor> b = bias.has_value() ? std::optional<at::Tensor>(bias->contiguous()) : bias;
    std::tie(std::ignore, gxl, gw, gb) = ce_pass(l.x, weight.contiguous(), b, l.target, row_grad, 1.0,
                                                 label_smoothing, grad_x, grad_weight, grad_bias, chunk_rows, backend);
  } else {
    gxl = at::zeros({0, h}, x.options());
    gw = grad_weight ? at::zeros_like(weight) : at::empty({0}, weight.options());
    gb = grad_bias ? at::zeros({v}, weight.options()) : at::empty({0}, weight.options());
  }
  at::Tensor gx = at::empty({0}, x.options());
  if (grad_x) {
    gx = l.idx.defined() ? at::zeros({x2.size(0), h}, x.options()).index_copy_(0, l.idx, gxl) : gxl;
    gx = gx.reshape(x.sizes());
  }
  return {gx, gw, gb};
}

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

// A row of 32k logits is ~30 us of row pass: a task of at least 32k elements amortises a thread's wake-up.
int64_t row_grain(int64_t row_len) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_len, 1)); }

Dtype kernel_dtype(const at::Tensor& t) { return t.scalar_type() == at::kFloat ? Dtype::kFloat : Dtype::kBFloat16; }

void rows_cpu(const at::Tensor& buf, const at::Tensor& target, const at::Tensor& row_grad, double scale, double eps,
              bool with_grad, const at::Tensor& loss) {
  if (buf.scalar_type() == at::kDouble) {
    ce_rows_aten(buf, target, row_grad, scale, eps, with_grad, loss);
    return;
  }
  const int64_t r = buf.size(0), v = buf.size(1);
  const Dtype dt = kernel_dtype(buf);
  const CeKernels& k = ce_kernels();
  void* base = buf.data_ptr();
  const int64_t* tp = target.const_data_ptr<int64_t>();
  const float* gp = row_grad.defined() ? row_grad.const_data_ptr<float>() : nullptr;
  float* lp = loss.data_ptr<float>();
  at::parallel_for(0, r, row_grain(v), [&](int64_t b, int64_t e) {
    k.rows(base, dt, v, tp, gp, float(scale), float(eps), with_grad, lp, b, e);
  });
}

// How partial products add up in fp32, exactly (each product summed in fp32 and rounded once, as torch's own matmul):
// "mkl" (MKL's bf16 x bf16 -> fp32 GEMM) on Intel CPUs; elsewhere "avx512bf16" (gemm_bf16.cpp, where the CPU has
// AVX-512 BF16) or "onednn" (oneDNN's fp32 matmul on the bf16 operands widened, exact since a product of two bf16
// fits in fp32), where MKL runs slow kernels. On a 2-core AMD EPYC Zen 5 (AVX-512 BF16), 2 threads, shapes like
// 1024 x 1024 @ 1024 x 256, MKL's GEMM summed at 164-199 GFLOP/s, oneDNN's fp32 one on widened operands at 334-428,
// ATen's bf16 matmul at 782-875; gemm_bf16.cpp's as fast as ATen's (its header). The op there at N 1024, H 256, V 32000, bf16,
// trained head, in vocabulary blocks: 152 ms with "mkl", 112 with "onednn", 92 with "avx512bf16" (torch.compile:
// 94-105; results/loss_zen5*.md). "product" (the driver's add_product: each partial rounded to bf16, then summed:
// 90 ms) is not exact enough to be a default: a 2-layer BERT trained by HF Trainer with it moved its grad norms 9%
// from the run without fastops within 10 steps (tests/test_patch_models.py), where the exact sums stay within
// bf16's rounding. It serves a torch and CPU with none of the others. FASTOPS_CE_ACCUMULATE=mkl|avx512bf16|onednn|
// product forces one (the tests run each).
bool onednn_usable() {
  // Probed once per process: serves() asks at every pick and at every call of ce_accumulate_with (the benchmark's
  // timed calls among them).
  static const bool usable = [] {
    // mkldnn_matmul refuses fp32 without these (its bf16 device check); serves() ran __builtin_cpu_init.
    if (at::native::mkldnn_matmul == nullptr || !__builtin_cpu_supports("avx512bw") ||
        !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512dq")) {
      return false;
    }
    try {  // its dtype checks are its own (torch 2.13 and 2.14 take fp32): one small product says whether it serves
      const at::Tensor a = at::full({2, 2}, 1.5f), c = at::full({2, 2}, 1.0f);
      at::native::mkldnn_matmul(a, a, c, 1.0f, 1.0f);
      return c.eq(5.5f).all().item<bool>();
    } catch (const c10::Error&) {
      return false;
    }
  }();
  return usable;
}

constexpr const char* kWays[] = {"product", "mkl", "avx512bf16", "onednn"};

// Whether the way named `how` serves with this CPU and torch (the oneDNN one probes once: ask only when needed).
bool serves(const std::string& how) {
  __builtin_cpu_init();
  if (how == "product") return true;
  if (how == "mkl") return cblas_gemm_bf16bf16f32 != nullptr;
  if (how == "avx512bf16") return gemm_bf16_usable();
  if (how == "onednn") return onednn_usable();
  return false;
}

const char* pick_accumulate() {
  if (const char* env = std::getenv("FASTOPS_CE_ACCUMULATE"); env && *env) {
    for (const char* how : kWays) {
      if (std::strcmp(env, how) == 0 && serves(how)) return how;
    }
    std::string here;
    for (const char* how : kWays) here += serves(how) ? std::string(here.empty() ? "" : ", ") + how : "";
    TORCH_WARN("fastops: ignoring FASTOPS_CE_ACCUMULATE=", env, " (expected ", here, " here)");
  }
  if (serves("mkl") && __builtin_cpu_is("intel")) return "mkl";  // no oneDNN probe where it would not be picked
  if (serves("avx512bf16")) return "avx512bf16";
  return serves("onednn") ? "onednn" : serves("mkl") ? "mkl" : "product";
}

// acc = a @ b (+ acc) through oneDNN's fp32 matmul on a and b widened from bf16/fp16.
bool accumulate_onednn(const at::Tensor& acc, const at::Tensor& a, const at::Tensor& b, bool first) {
  if (a.scalar_type() == at::kFloat || !acc.is_contiguous()) return false;
  at::native::mkldnn_matmul(a.to(at::kFloat), b.to(at::kFloat), acc, first ? 0.0f : 1.0f, 1.0f);
  return true;
}

// acc = a @ b (+ acc), a a row-major matrix or the transposed view of one, b row-major, acc contiguous.
bool accumulate_mkl(const at::Tensor& acc, const at::Tensor& a, const at::Tensor& b, bool first) {
  if (cblas_gemm_bf16bf16f32 == nullptr || a.scalar_type() != at::kBFloat16 || b.scalar_type() != at::kBFloat16) {
    return false;
  }
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  const bool trans = a.stride(1) != 1;  // a = (row-major k x m)^T
  const int64_t lda = trans ? a.stride(1) : a.stride(0), ldb = b.stride(0);
  constexpr int64_t kIntMax = 2147483647;
  if ((trans ? a.stride(0) != 1 || lda < m : lda < k) || b.stride(1) != 1 || ldb < n || !acc.is_contiguous() ||
      std::max({m, n, k, lda, ldb}) > kIntMax) {
    return false;
  }
  // Row-major (101); op(a) transposed (112) or not (111), b not.
  cblas_gemm_bf16bf16f32(101, trans ? 112 : 111, 111, int(m), int(n), int(k), 1.0f,
                         reinterpret_cast<const uint16_t*>(a.const_data_ptr()), int(lda),
                         reinterpret_cast<const uint16_t*>(b.const_data_ptr()), int(ldb), first ? 0.0f : 1.0f,
                         acc.data_ptr<float>(), int(n));
  return true;
}

// acc = a @ b (+ acc) through gemm_bf16.cpp: a a matrix with unit stride along either dimension, b row-major.
bool accumulate_bf16(const at::Tensor& acc, const at::Tensor& a, const at::Tensor& b, bool first) {
  if (a.scalar_type() != at::kBFloat16 || b.scalar_type() != at::kBFloat16 || b.stride(1) != 1 ||
      (a.stride(0) != 1 && a.stride(1) != 1) || !acc.is_contiguous() || acc.scalar_type() != at::kFloat) {
    return false;
  }
  gemm_bf16_f32(reinterpret_cast<const uint16_t*>(a.const_data_ptr()), a.stride(0), a.stride(1),
                reinterpret_cast<const uint16_t*>(b.const_data_ptr()), b.stride(0), acc.data_ptr<float>(), a.size(0),
                b.size(1), a.size(1), first);
  return true;
}

// The vocabulary blocks' passes over rows, threaded as rows_cpu (a block row counts as a row).
void block_stats_cpu(const at::Tensor& z, int64_t v0, const at::Tensor& target, const at::Tensor& mx,
                     const at::Tensor& s, const at::Tensor& zs, const at::Tensor& zt) {
  const int64_t vb = z.size(1);
  const Dtype dt = kernel_dtype(z);
  const CeKernels& k = ce_kernels();
  const void* base = z.const_data_ptr();
  const int64_t* tp = target.const_data_ptr<int64_t>();
  float *mp = mx.data_ptr<float>(), *sp = s.data_ptr<float>(), *zsp = zs.data_ptr<float>(), *ztp = zt.data_ptr<float>();
  at::parallel_for(0, z.size(0), row_grain(vb), [&](int64_t b, int64_t e) {
    k.block_stats(base, dt, vb, v0, tp, mp, sp, zsp, ztp, b, e);
  });
}

void block_grad_cpu(const at::Tensor& z, int64_t v0, int64_t v, const at::Tensor& target, const at::Tensor& row_grad,
                    double scale, double eps, const at::Tensor& lse) {
  const int64_t vb = z.size(1);
  const Dtype dt = kernel_dtype(z);
  const CeKernels& k = ce_kernels();
  void* base = z.data_ptr();
  const int64_t* tp = target.const_data_ptr<int64_t>();
  const float* gp = row_grad.defined() ? row_grad.const_data_ptr<float>() : nullptr;
  const float* lp = lse.const_data_ptr<float>();
  at::parallel_for(0, z.size(0), row_grain(vb), [&](int64_t b, int64_t e) {
    k.block_grad(base, dt, vb, v0, v, tp, gp, float(scale), float(eps), lp, b, e);
  });
}

CeAccumulate accumulator(const char* how) {
  if (std::strcmp(how, "mkl") == 0) return accumulate_mkl;
  if (std::strcmp(how, "avx512bf16") == 0) return accumulate_bf16;
  if (std::strcmp(how, "onednn") == 0) return accumulate_onednn;
  return {};
}

const CeBackend& cpu_backend() {
  static const CeBackend b{rows_cpu, accumulator(ce_accumulate()), false, block_stats_cpu, block_grad_cpu};
  return b;
}

}  // namespace

const char* ce_accumulate() {
  static const char* const how = pick_accumulate();
  return how;
}

bool ce_accumulate_with(const std::string& how, const at::Tensor& acc, const at::Tensor& a, const at::Tensor& b,
                        bool first) {
  const CeAccumulate f = accumulator(how.c_str());
  TORCH_CHECK(how == "product" || f, "fastops: no partial-product way named ", how);
  TORCH_CHECK(serves(how), "fastops: the partial-product way ", how, " does not serve with this CPU and torch");
  const bool served = f && f(acc, a, b, first);
  if (!served) add_product(acc, a, b, first);
  return served;
}

FASTOPS_CE_ENTRY_POINTS(cpu_backend())

}  // namespace cpu
}  // namespace fastops
