// The torch side of the CUDA kernels (adam.cu, adam_lowp.cu, sgd.cu, amp.cu): the current device and stream, the
// launches over the cached pointer tables (tables.cpp), and the pybind11 functions fastops._backend looks up on
// fastops._C.cuda, each running the op's check and its launches in one call (csrc/generated/op_bindings.h). So the
// arguments arrive checked; only that the tensors are on CUDA is checked again here. Compiled only in CUDA builds
// (-DWITH_CUDA); the kernels themselves include no torch header, so they compile (and are compile-checked by
// `python -m fastops compile-check`) without one.
//
// Nothing here reads a device value on the host: lr, grad_scale, found_inf and inv_scale on the tensors'
// device are passed to the kernels as pointers, the step counters are bumped by a device op, and a table
// is uploaded with a non-blocking copy from pinned memory. That keeps every op free of syncs and
// capturable in a CUDA graph.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "cuda/host.h"
#include "cuda/kernels.cuh"
#include "cuda/tables.h"
#include "fastops.h"
#include "generated/op_bindings.h"

namespace fastops {
namespace cuda {
namespace {

struct LaunchContext {
  cudaStream_t stream;
  bool capturing;
  int max_blocks;
};

LaunchContext launch_context() {
  LaunchContext ctx;
  ctx.stream = at::cuda::getCurrentCUDAStream().stream();
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(ctx.stream, &status));
  ctx.capturing = status != cudaStreamCaptureStatusNone;
  // Four 512-thread blocks an SM fill its 2048 thread slots; the blocks grid-stride over the chunks.
  ctx.max_blocks = at::cuda::getCurrentDeviceProperties()->multiProcessorCount * (2048 / kThreads);
  return ctx;
}

std::vector<int64_t> grad_rows(const TensorList& grads, const std::vector<size_t>& idx) {
  std::vector<int64_t> flat;
  flat.reserve(idx.size() * kGradCols);
  for (size_t i : idx) {
    flat.push_back(address(grads[i].const_data_ptr()));
    flat.push_back(grads[i].numel());
  }
  return flat;
}

void check_on_cuda(const TensorList& tensors, const char* op) {
  TORCH_CHECK(tensors.empty() || tensors[0].is_cuda(), "fastops.", op, " (CUDA backend): tensors are on ",
              tensors[0].device().str(), "; these kernels take CUDA tensors");
}

// What adam_step_ and adam_step_lowp_ share: the step counters, the launch scalars every Adam kernel takes (into k's
// AdamCommonArgs; the op's own fields are set by the caller), then one launch per param dtype over a table of
// host.h's adam_rows.
template <class KernelArgs, class OpArgs, class Own>
void launch_adam(int64_t tag, KernelArgs k, const OpArgs& a, const Own& own,
                 cudaError_t (*launch)(ScalarKind, const KernelArgs&, int, cudaStream_t)) {
  const at::Device device = a.params[0].device();
  const c10::cuda::CUDAGuard guard(device);
  const LaunchContext ctx = launch_context();
  const LaunchScalars sc = launch_scalars(a, device);
  if (sc.skip) return;
  bump_steps(a.state_steps, sc);
  set_adam_scalars(k, a, sc);
  for (const auto& group : group_by_dtype(a.params)) {
    const std::vector<int64_t> flat = adam_rows(a, group.second, own);
    const int64_t cols = static_cast<int64_t>(flat.size() / group.second.size());
    const auto t = table(tag, flat, cols, device, ctx.stream, ctx.capturing);
    if (t->n_chunks == 0) continue;
    k.tensors = t->rows();
    k.chunks = t->chunks();
    k.n_chunks = t->n_chunks;
    C10_CUDA_CHECK(launch(kind_of(group.first), k, ctx.max_blocks, ctx.stream));
  }
}

void adam_step_(const AdamStepArgs& a) {
  check_on_cuda(a.params, "adam_step_");
  if (a.params.empty()) return;
  AdamArgs k{};
  k.amsgrad = a.amsgrad;
  launch_adam(kAdamTag, k, a, adam_own(a), adam_step);
}

void adam_step_lowp_(const AdamStepLowpArgs& a) {
  check_on_cuda(a.params, "adam_step_lowp_");
  if (a.params.empty()) return;
  const AdamLowpArgs k = lowp_args(a);
  launch_adam(kLowpTag, k, a, lowp_own(a, k.format == StateFormat::kEightBit), adam_step_lowp);
}

void sgd_step_(const SgdStepArgs& a) {
  check_on_cuda(a.params, "sgd_step_");
  if (a.params.empty()) return;
  const at::Device device = a.params[0].device();
  const c10::cuda::CUDAGuard guard(device);
  const LaunchContext ctx = launch_context();
  const LaunchScalars sc = launch_scalars(a, device);
  if (sc.skip) return;

  SgdArgs k{};
  k.lr_ptr = sc.lr.ptr();
  k.lr = static_cast<float>(sc.lr.value);
  k.grad_scale_ptr = sc.scale.ptr();
  k.grad_scale = a.grad_scale.has_value() ? static_cast<float>(sc.scale.value) : 1.0f;
  k.has_grad_scale = a.grad_scale.has_value();
  k.found_inf = sc.inf.ptr();
  k.weight_decay = static_cast<float>(a.weight_decay);
  k.momentum = static_cast<float>(a.momentum);
  k.one_minus_dampening = static_cast<float>(1 - a.dampening);
  k.momentum_mode = a.momentum == 0 ? 0 : (a.is_first_step ? 1 : 2);
  k.nesterov = a.nesterov && a.momentum != 0;
  k.maximize = a.maximize;
  k.has_master = !a.master_params.empty();

  for (const auto& group : group_by_dtype(a.params)) {
    std::vector<int64_t> flat;
    flat.reserve(group.second.size() * kSgdCols);
    for (size_t i : group.second) {
      flat.push_back(address(a.params[i].data_ptr()));
      flat.push_back(address(a.grads[i].const_data_ptr()));
      flat.push_back(k.momentum_mode != 0 ? address(a.momentum_buffers[i].data_ptr()) : 0);
      flat.push_back(k.has_master ? address(a.master_params[i].data_ptr()) : 0);
      flat.push_back(a.params[i].numel());
    }
    const auto t = table(kSgdTag, flat, kSgdCols, device, ctx.stream, ctx.capturing);
    if (t->n_chunks == 0) continue;
    k.tensors = t->rows();
    k.chunks = t->chunks();
    k.n_chunks = t->n_chunks;
    C10_CUDA_CHECK(sgd_step(kind_of(group.first), k, ctx.max_blocks, ctx.stream));
  }
}

void unscale_check_(const UnscaleCheckArgs& a) {
  check_on_cuda(a.grads, "unscale_check_");
  if (a.grads.empty()) return;
  const at::Device device = a.grads[0].device();
  const c10::cuda::CUDAGuard guard(device);
  const LaunchContext ctx = launch_context();
  const ScalarArg inv = scalar_arg(a.inv_scale, device);
  float* found = a.found_inf.mutable_data_ptr<float>();
  for (const auto& group : group_by_dtype(a.grads)) {
    const auto t = table(kGradTag, grad_rows(a.grads, group.second), kGradCols, device, ctx.stream, ctx.capturing);
    C10_CUDA_CHECK(unscale_check(kind_of(group.first), t->rows(), t->chunks(), t->n_chunks, found, inv.ptr(),
                                 static_cast<float>(inv.value), ctx.max_blocks, ctx.stream));
  }
}

at::Tensor grad_stats(const GradStatsArgs& a) {
  check_on_cuda(a.grads, "grad_stats");
  const at::Device device = a.grads[0].device();
  const c10::cuda::CUDAGuard guard(device);
  const LaunchContext ctx = launch_context();
  ScalarArg inv;
  inv.value = 1.0;
  if (a.inv_scale.has_value()) inv = scalar_arg(*a.inv_scale, device);
  std::vector<std::pair<ScalarKind, std::shared_ptr<DeviceTable>>> groups;
  int64_t total = 0;
  for (const auto& group : group_by_dtype(a.grads)) {
    groups.emplace_back(kind_of(group.first), table(kGradTag, grad_rows(a.grads, group.second), kGradCols, device,
                                                    ctx.stream, ctx.capturing));
    total += groups.back().second->n_chunks;
  }
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  at::Tensor out = at::empty({3}, f32);
  // At least one partial's room, so the pointer is real even when every grad is empty.
  at::Tensor partials = at::empty({3 * std::max<int64_t>(total, 1)}, f32);
  int64_t first = 0;
  for (const auto& g : groups) {
    C10_CUDA_CHECK(grad_stats_partials(g.first, g.second->rows(), g.second->chunks(), g.second->n_chunks,
                                       partials.mutable_data_ptr<float>(), first, inv.ptr(),
                                       static_cast<float>(inv.value), ctx.max_blocks, ctx.stream));
    first += g.second->n_chunks;
  }
  C10_CUDA_CHECK(
      grad_stats_reduce(partials.const_data_ptr<float>(), total, out.mutable_data_ptr<float>(), ctx.stream));
  return out;
}

at::Tensor dropout_op(const DropoutArgs& a) {
  check_on_cuda({a.x}, "dropout");
  const c10::cuda::CUDAGuard guard(a.x.device());
  const LaunchContext ctx = launch_context();
  at::Tensor out = at::empty_like(a.x);  // preserve_format: x's memory order
  const cpu::DropoutConsts c = cpu::dropout_consts(a.p, a.seed, a.x.scalar_type());
  C10_CUDA_CHECK(cuda::dropout(kind_of(a.x.scalar_type()), a.x.const_data_ptr(), out.mutable_data_ptr(), a.x.numel(),
                               c.key, c.threshold, c.scale, ctx.max_blocks, ctx.stream));
  return out;
}

}  // namespace

void register_bindings(pybind11::module_ m) {
  def_adam_step_(m, adam_step_);
  def_adam_step_lowp_(m, adam_step_lowp_);
  def_sgd_step_(m, sgd_step_);
  def_unscale_check_(m, unscale_check_);
  def_grad_stats(m, grad_stats);
  def_dropout(m, dropout_op);
  register_linear_ce(m);
}

}  // namespace cuda
}  // namespace fastops
