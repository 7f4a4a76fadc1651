// The torch side of the CUDA kernels (adam.cu, adam_lowp.cu, sgd.cu, amp.cu): the current device and stream,
// the pointer tables and their cache, and the pybind11 definitions fastops._backend looks up on
// fastops._C.cuda. The arguments arrive checked (the op's dispatcher kernel, fastops/_ops.py, runs each op's
// check once); only that the tensors are on CUDA is checked again here. Compiled only in CUDA builds
// (-DWITH_CUDA); the kernels themselves include no torch header, so they compile (and are compile-checked by
// `python -m fastops compile-check`) without one.
//
// Nothing here reads a device value on the host: lr, grad_scale, found_inf and inv_scale on the tensors'
// device are passed to the kernels as pointers, the step counters are bumped by a device op, and a table
// is uploaded with a non-blocking copy from pinned memory. That keeps every op free of syncs and
// capturable in a CUDA graph.
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../fastops.h"
#include "kernels.cuh"

namespace fastops {
namespace cuda {
namespace {

using TensorList = std::vector<at::Tensor>;
using Key = std::vector<int64_t>;

ScalarKind kind_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return ScalarKind::kFloat32;
    case at::kBFloat16:
      return ScalarKind::kBFloat16;
    case at::kHalf:
      return ScalarKind::kFloat16;
    default:
      TORCH_CHECK(false, "fastops (CUDA backend): unsupported dtype ", t);
  }
  return ScalarKind::kFloat32;  // unreachable
}

int64_t address(const void* p) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(p)); }

// Tensor indices grouped by dtype, in the order fp32, bf16, fp16: one launch per non-empty group.
std::vector<std::pair<at::ScalarType, std::vector<size_t>>> group_by_dtype(const TensorList& ts) {
  std::vector<std::pair<at::ScalarType, std::vector<size_t>>> groups = {
      {at::kFloat, {}}, {at::kBFloat16, {}}, {at::kHalf, {}}};
  for (size_t i = 0; i < ts.size(); ++i) {
    for (auto& g : groups) {
      if (g.first == ts[i].scalar_type()) g.second.push_back(i);
    }
  }
  groups.erase(std::remove_if(groups.begin(), groups.end(), [](const auto& g) { return g.second.empty(); }),
               groups.end());
  return groups;
}

// A per-tensor table (rows x cols, the last column numel) followed by the chunk table (n_chunks x 2:
// tensor index, chunk index), in one device tensor.
struct DeviceTable {
  at::Tensor host;  // pinned source of the upload; a graph captured with this table reads it on replay
  at::Tensor device;
  int64_t n_rows = 0;
  int64_t cols = 0;
  int64_t n_chunks = 0;
  std::vector<cudaStream_t> streams;  // streams the table was used on; the first is the allocating one

  const int64_t* rows() const { return device.const_data_ptr<int64_t>(); }
  const int64_t* chunks() const { return rows() + n_rows * cols; }
};

std::shared_ptr<DeviceTable> build_table(const std::vector<int64_t>& flat, int64_t cols, const at::Device& device,
                                         cudaStream_t stream) {
  auto t = std::make_shared<DeviceTable>();
  t->cols = cols;
  t->n_rows = static_cast<int64_t>(flat.size()) / cols;
  for (int64_t r = 0; r < t->n_rows; ++r) t->n_chunks += (flat[r * cols + cols - 1] + kChunkSize - 1) / kChunkSize;
  const int64_t total = t->n_rows * cols + 2 * t->n_chunks;
  t->host = at::empty({total}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* h = t->host.mutable_data_ptr<int64_t>();
  std::copy(flat.begin(), flat.end(), h);
  int64_t* c = h + t->n_rows * cols;
  for (int64_t r = 0; r < t->n_rows; ++r) {
    const int64_t n = (flat[r * cols + cols - 1] + kChunkSize - 1) / kChunkSize;
    for (int64_t k = 0; k < n; ++k) {
      *c++ = r;
      *c++ = k;
    }
  }
  t->device = at::empty({total}, at::TensorOptions().dtype(at::kLong).device(device));
  t->device.copy_(t->host, /*non_blocking=*/true);
  t->streams.push_back(stream);
  return t;
}

struct KeyHash {
  size_t operator()(const Key& k) const noexcept {
    uint64_t h = 0x9e3779b97f4a7c15ull;
    for (int64_t x : k) h ^= static_cast<uint64_t>(x) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    return static_cast<size_t>(h);
  }
};

// A small LRU of device tables keyed by everything a table holds (device, layout, pointers, numels), so
// an entry is right whenever its key matches. A steady training loop builds each table once and then only
// hashes pointers. A table used during CUDA-graph capture leaves the LRU and is never freed: the graph
// reads it on every replay.
class TableCache {
 public:
  std::shared_ptr<DeviceTable> get(const Key& key, const std::vector<int64_t>& flat, int64_t cols,
                                   const at::Device& device, cudaStream_t stream, bool capturing) {
    std::lock_guard<std::mutex> lock(mu_);
    std::shared_ptr<DeviceTable> t;
    auto pinned = pinned_.find(key);
    if (pinned != pinned_.end()) {
      t = pinned->second;
    } else {
      auto it = index_.find(key);
      if (it != index_.end()) {
        t = it->second->second;
        if (capturing) {
          lru_.erase(it->second);
          index_.erase(it);
          pinned_.emplace(key, t);
        } else {
          lru_.splice(lru_.begin(), lru_, it->second);
        }
      } else {
        t = build_table(flat, cols, device, stream);
        if (capturing) {
          pinned_.emplace(key, t);
        } else {
          lru_.emplace_front(key, t);
          index_.emplace(key, lru_.begin());
          while (lru_.size() > kCapacity) {
            index_.erase(lru_.back().first);
            lru_.pop_back();
          }
        }
      }
    }
    // The caching allocator ties a block to the stream it was allocated on; used on another stream and then
    // evicted, it could be handed out while that stream's kernel still reads it.
    if (std::find(t->streams.begin(), t->streams.end(), stream) == t->streams.end()) {
      t->device.record_stream(at::cuda::getCurrentCUDAStream());
      t->streams.push_back(stream);
    }
    return t;
  }

 private:
  static constexpr size_t kCapacity = 64;
  std::mutex mu_;
  std::list<std::pair<Key, std::shared_ptr<DeviceTable>>> lru_;
  std::unordered_map<Key, std::list<std::pair<Key, std::shared_ptr<DeviceTable>>>::iterator, KeyHash> index_;
  std::unordered_map<Key, std::shared_ptr<DeviceTable>, KeyHash> pinned_;
};

TableCache& tables() {
  static TableCache cache;
  return cache;
}

// Tags that keep the Adam, SGD and grad tables apart in the cache key.
constexpr int64_t kAdamTag = 1;
constexpr int64_t kGradTag = 2;
constexpr int64_t kSgdTag = 3;
constexpr int64_t kLowpTag = 4;

Key make_key(int64_t tag, const at::Device& device, const std::vector<int64_t>& flat) {
  Key key;
  key.reserve(flat.size() + 3);
  key.push_back(tag);
  key.push_back(device.index());
  key.push_back(kChunkSize);
  key.insert(key.end(), flat.begin(), flat.end());
  return key;
}

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

// A one-element tensor the kernel reads: through a pointer when it is on the tensors' device (as fp32),
// else its value, read here from the CPU (no device sync).
struct ScalarArg {
  at::Tensor on_device;
  double value = 0;
  const float* ptr() const { return on_device.defined() ? on_device.const_data_ptr<float>() : nullptr; }
};

ScalarArg scalar_arg(const at::Tensor& t, const at::Device& device) {
  ScalarArg s;
  if (t.device() == device) {
    // A device-side cast when needed (a queued op, no sync); the cast copy lives until the launch is queued,
    // and the caching allocator orders its reuse after that launch.
    s.on_device = t.scalar_type() == at::kFloat ? t : t.to(at::kFloat);
  } else {
    s.value = t.item<double>();  // a CPU tensor (the op's check): no device sync
  }
  return s;
}

// lr, grad_scale and found_inf of an optimizer step. skip: found_inf is a CPU tensor that is set, so there is
// nothing to launch.
struct StepScalars {
  ScalarArg lr, scale, inf;
  bool skip = false;
};

StepScalars step_scalars(const at::Device& device, const at::Tensor& lr,
                         const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  StepScalars sc;
  sc.lr = scalar_arg(lr, device);
  if (grad_scale.has_value()) sc.scale = scalar_arg(*grad_scale, device);
  if (found_inf.has_value()) {
    sc.inf = scalar_arg(*found_inf, device);
    sc.skip = !sc.inf.on_device.defined() && sc.inf.value != 0;
  }
  return sc;
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

void check_on_cuda(const at::Tensor& first, const char* op) {
  TORCH_CHECK(first.is_cuda(), "fastops.", op, " (CUDA backend): tensors are on ", first.device().str(),
              "; these kernels take CUDA tensors");
}

// What adam_step_ and adam_step_lowp_ share: the device checks, the step counters,
// the launch scalars every Adam kernel takes (into a's AdamCommonArgs; the op's own fields are set by the caller),
// then one launch per param dtype over a table whose rows are the common columns (kernels.cuh's AdamCol), then
// own(i) (tensor i's own columns), then numel.
template <class Args, class Own>
void launch_adam(const char* op, int64_t tag, Args a, const TensorList& params, const TensorList& grads,
                 const TensorList& exp_avgs, const TensorList& exp_avg_sqs, const TensorList& state_steps,
                 const TensorList& master_params, const at::Tensor& lr, double beta1, double beta2, double eps,
                 double weight_decay, bool maximize, bool decoupled, const std::optional<at::Tensor>& grad_scale,
                 const std::optional<at::Tensor>& found_inf, const Own& own,
                 cudaError_t (*launch)(ScalarKind, const Args&, int, cudaStream_t)) {
  if (params.empty()) return;
  const at::Device device = params[0].device();
  check_on_cuda(params[0], op);
  for (size_t i = 0; i < state_steps.size(); ++i) {
    TORCH_CHECK(state_steps[i].device() == device, "fastops.", op, ": state_steps[", i, "] is on ",
                state_steps[i].device().str(), " but params[0] is on ", device.str(),
                "; the kernel reads each step through a pointer");
  }
  const c10::cuda::CUDAGuard guard(device);
  const LaunchContext ctx = launch_context();
  const StepScalars sc = step_scalars(device, lr, grad_scale, found_inf);
  if (sc.skip) return;
  // The kernels skip the whole step when *found_inf != 0; the counters follow with a device op.
  if (sc.inf.on_device.defined()) {
    at::_foreach_add_(state_steps, sc.inf.on_device.reshape({}).eq(at::Scalar(0.0)).to(at::kFloat));
  } else {
    at::_foreach_add_(state_steps, at::Scalar(1.0));
  }

  AdamCommonArgs& c = a;
  c.lr_ptr = sc.lr.ptr();
  c.lr = static_cast<float>(sc.lr.value);
  c.decay = static_cast<float>(1 - sc.lr.value * weight_decay);
  c.grad_scale_ptr = sc.scale.ptr();
  c.grad_scale = grad_scale.has_value() ? static_cast<float>(sc.scale.value) : 1.0f;
  c.has_grad_scale = grad_scale.has_value();
  c.found_inf = sc.inf.ptr();
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1 - beta2);
  c.lerp_weight = static_cast<float>(1 - beta1);
  c.lerp_small = std::abs(c.lerp_weight) < 0.5f;
  c.beta1_64 = beta1;
  c.beta2_64 = beta2;
  c.eps = static_cast<float>(eps);
  c.weight_decay = static_cast<float>(weight_decay);
  c.weight_decay64 = weight_decay;
  c.wd_mode = weight_decay == 0 ? 0 : (decoupled ? 2 : 1);
  c.maximize = maximize;
  c.has_master = !master_params.empty();

  for (const auto& group : group_by_dtype(params)) {
    std::vector<int64_t> flat;
    for (size_t i : group.second) {
      flat.push_back(address(params[i].data_ptr()));
      flat.push_back(address(grads[i].const_data_ptr()));
      flat.push_back(address(exp_avgs[i].data_ptr()));
      flat.push_back(address(exp_avg_sqs[i].data_ptr()));
      flat.push_back(c.has_master ? address(master_params[i].data_ptr()) : 0);
      flat.push_back(address(state_steps[i].data_ptr()));
      own(i, flat);
      flat.push_back(params[i].numel());
    }
    const int64_t cols = static_cast<int64_t>(flat.size() / group.second.size());
    const auto table = tables().get(make_key(tag, device, flat), flat, cols, device, ctx.stream, ctx.capturing);
    if (table->n_chunks == 0) continue;
    c.tensors = table->rows();
    c.chunks = table->chunks();
    c.n_chunks = table->n_chunks;
    C10_CUDA_CHECK(launch(kind_of(group.first), a, ctx.max_blocks, ctx.stream));
  }
}

void adam_step_(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                const TensorList& exp_avg_sqs, const TensorList& max_exp_avg_sqs, const TensorList& state_steps,
                const TensorList& master_params, const at::Tensor& lr, double beta1, double beta2, double eps,
                double weight_decay, bool amsgrad, bool maximize, bool decoupled,
                const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  AdamArgs a{};
  a.amsgrad = amsgrad;
  launch_adam("adam_step_", kAdamTag, a, params, grads, exp_avgs, exp_avg_sqs, state_steps, master_params, lr, beta1,
              beta2, eps, weight_decay, maximize, decoupled, grad_scale, found_inf,
              [&](size_t i, std::vector<int64_t>& row) {
                row.push_back(amsgrad ? address(max_exp_avg_sqs[i].data_ptr()) : 0);
              },
              adam_step);
}

void adam_step_lowp_(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                     const TensorList& exp_avg_sqs, const TensorList& exp_avg_absmax,
                     const TensorList& exp_avg_sq_absmax, const TensorList& state_steps,
                     const TensorList& master_params, const at::Tensor& lr, double beta1, double beta2, double eps,
                     double weight_decay, bool maximize, bool decoupled, int64_t seed,
                     const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  if (params.empty()) return;
  AdamLowpArgs a{};
  a.eight_bit = exp_avgs[0].scalar_type() == at::kByte;
  a.seed = static_cast<uint32_t>(static_cast<uint64_t>(seed) & 0xFFFFFFFFu);
  launch_adam("adam_step_lowp_", kLowpTag, a, params, grads, exp_avgs, exp_avg_sqs, state_steps, master_params, lr,
              beta1, beta2, eps, weight_decay, maximize, decoupled, grad_scale, found_inf,
              [&](size_t i, std::vector<int64_t>& row) {
                row.push_back(a.eight_bit ? address(exp_avg_absmax[i].data_ptr()) : 0);
                row.push_back(a.eight_bit ? address(exp_avg_sq_absmax[i].data_ptr()) : 0);
                row.push_back(static_cast<int64_t>(i));
              },
              adam_step_lowp);
}

void sgd_step_(const TensorList& params, const TensorList& grads, const TensorList& momentum_buffers,
               const TensorList& master_params, const at::Tensor& lr, double weight_decay, double momentum,
               double dampening, bool nesterov, bool maximize, bool is_first_step,
               const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  if (params.empty()) return;
  const at::Device device = params[0].device();
  check_on_cuda(params[0], "sgd_step_");
  const c10::cuda::CUDAGuard guard(device);
  const LaunchContext ctx = launch_context();
  const StepScalars sc = step_scalars(device, lr, grad_scale, found_inf);
  if (sc.skip) return;

  SgdArgs a{};
  a.lr_ptr = sc.lr.ptr();
  a.lr = static_cast<float>(sc.lr.value);
  a.grad_scale_ptr = sc.scale.ptr();
  a.grad_scale = grad_scale.has_value() ? static_cast<float>(sc.scale.value) : 1.0f;
  a.has_grad_scale = grad_scale.has_value();
  a.found_inf = sc.inf.ptr();
  a.weight_decay = static_cast<float>(weight_decay);
  a.momentum = static_cast<float>(momentum);
  a.one_minus_dampening = static_cast<float>(1 - dampening);
  a.momentum_mode = momentum == 0 ? 0 : (is_first_step ? 1 : 2);
  a.nesterov = nesterov && momentum != 0;
  a.maximize = maximize;
  a.has_master = !master_params.empty();

  for (const auto& group : group_by_dtype(params)) {
    std::vector<int64_t> flat;
    flat.reserve(group.second.size() * kSgdCols);
    for (size_t i : group.second) {
      flat.push_back(address(params[i].data_ptr()));
      flat.push_back(address(grads[i].const_data_ptr()));
      flat.push_back(a.momentum_mode != 0 ? address(momentum_buffers[i].data_ptr()) : 0);
      flat.push_back(a.has_master ? address(master_params[i].data_ptr()) : 0);
      flat.push_back(params[i].numel());
    }
    const auto table =
        tables().get(make_key(kSgdTag, device, flat), flat, kSgdCols, device, ctx.stream, ctx.capturing);
    if (table->n_chunks == 0) continue;
    a.tensors = table->rows();
    a.chunks = table->chunks();
    a.n_chunks = table->n_chunks;
    C10_CUDA_CHECK(sgd_step(kind_of(group.first), a, ctx.max_blocks, ctx.stream));
  }
}

void unscale_check_(const TensorList& grads, const at::Tensor& found_inf, const at::Tensor& inv_scale) {
  if (grads.empty()) return;
  const at::Device device = grads[0].device();
  check_on_cuda(grads[0], "unscale_check_");
  const c10::cuda::CUDAGuard guard(device);
  const LaunchContext ctx = launch_context();
  const ScalarArg inv = scalar_arg(inv_scale, device);
  float* found = found_inf.mutable_data_ptr<float>();
  for (const auto& group : group_by_dtype(grads)) {
    const std::vector<int64_t> flat = grad_rows(grads, group.second);
    const auto table =
        tables().get(make_key(kGradTag, device, flat), flat, kGradCols, device, ctx.stream, ctx.capturing);
    C10_CUDA_CHECK(unscale_check(kind_of(group.first), table->rows(), table->chunks(), table->n_chunks, found,
                                 inv.ptr(), static_cast<float>(inv.value), ctx.max_blocks, ctx.stream));
  }
}

at::Tensor grad_stats(const TensorList& grads, const std::optional<at::Tensor>& inv_scale) {
  TORCH_CHECK(!grads.empty(), "fastops.grad_stats: needs at least one tensor");
  const at::Device device = grads[0].device();
  check_on_cuda(grads[0], "grad_stats");
  const c10::cuda::CUDAGuard guard(device);
  const LaunchContext ctx = launch_context();
  ScalarArg inv;
  inv.value = 1.0;
  if (inv_scale.has_value()) {
    inv = scalar_arg(*inv_scale, device);
  }
  std::vector<std::pair<ScalarKind, std::shared_ptr<DeviceTable>>> groups;
  int64_t total = 0;
  for (const auto& group : group_by_dtype(grads)) {
    const std::vector<int64_t> flat = grad_rows(grads, group.second);
    groups.emplace_back(kind_of(group.first), tables().get(make_key(kGradTag, device, flat), flat, kGradCols,
                                                           device, ctx.stream, ctx.capturing));
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

}  // namespace

void register_bindings(pybind11::module_ m) {
  namespace py = pybind11;
  m.def("adam_step_", &adam_step_, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
        py::arg("max_exp_avg_sqs"), py::arg("state_steps"), py::arg("master_params"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("amsgrad"),
        py::arg("maximize"), py::arg("decoupled"), py::arg("grad_scale"), py::arg("found_inf"),
        py::call_guard<py::gil_scoped_release>());
  m.def("adam_step_lowp_", &adam_step_lowp_, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"),
        py::arg("exp_avg_sqs"), py::arg("exp_avg_absmax"), py::arg("exp_avg_sq_absmax"), py::arg("state_steps"),
        py::arg("master_params"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("maximize"), py::arg("decoupled"), py::arg("seed"), py::arg("grad_scale"),
        py::arg("found_inf"), py::call_guard<py::gil_scoped_release>());
  m.def("sgd_step_", &sgd_step_, py::arg("params"), py::arg("grads"), py::arg("momentum_buffers"),
        py::arg("master_params"), py::arg("lr"), py::arg("weight_decay"), py::arg("momentum"), py::arg("dampening"),
        py::arg("nesterov"), py::arg("maximize"), py::arg("is_first_step"), py::arg("grad_scale"),
        py::arg("found_inf"), py::call_guard<py::gil_scoped_release>());
  m.def("unscale_check_", &unscale_check_, py::arg("grads"), py::arg("found_inf"), py::arg("inv_scale"),
        py::call_guard<py::gil_scoped_release>());
  m.def("grad_stats", &grad_stats, py::arg("grads"), py::arg("inv_scale") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  register_linear_ce(m);
}

}  // namespace cuda
}  // namespace fastops
