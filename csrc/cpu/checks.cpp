// TORCH_CHECK versions of fastops/_checks.py. The messages spell shapes, strides, dtypes and devices the
// way Python prints them ("(4,)", "torch.float32", "cuda:0"); they are built only when a check fails.
#include <cctype>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <string>

#include <c10/util/Exception.h>
#include <torch/library.h>

#include "fastops.h"

namespace fastops {
namespace {

std::string py_tuple(c10::IntArrayRef v) {
  std::ostringstream os;
  os << '(';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) os << ", ";
    os << v[i];
  }
  if (v.size() == 1) os << ',';
  os << ')';
  return os.str();
}

std::string py_dtype(at::ScalarType t) {
  switch (t) {
    case at::kByte: return "torch.uint8";
    case at::kChar: return "torch.int8";
    case at::kShort: return "torch.int16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kHalf: return "torch.float16";
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kComplexHalf: return "torch.complex32";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    case at::kBool: return "torch.bool";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kUInt16: return "torch.uint16";
    case at::kUInt32: return "torch.uint32";
    case at::kUInt64: return "torch.uint64";
    case at::kFloat8_e5m2: return "torch.float8_e5m2";
    case at::kFloat8_e4m3fn: return "torch.float8_e4m3fn";
    case at::kFloat8_e5m2fnuz: return "torch.float8_e5m2fnuz";
    case at::kFloat8_e4m3fnuz: return "torch.float8_e4m3fnuz";
    default: {
      std::string s = c10::toString(t);
      for (auto& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
      return "torch." + s;
    }
  }
}

inline bool is_float(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

void check_dense(const at::Tensor& t, const std::string& what) {
  TORCH_CHECK(t.layout() == at::kStrided, "fastops: ", what,
              " is sparse; only dense (strided) tensors are supported");
  TORCH_CHECK(!t.is_complex(), "fastops: ", what, " is complex; complex tensors are not supported");
  TORCH_CHECK(t.is_contiguous() || t.is_non_overlapping_and_dense(), "fastops: ", what,
              " is not contiguous (its memory is strided with gaps or overlaps); "
              "fused kernels walk the tensor's memory as one block");
}

// dtype: the required dtype, or ref's dtype when kUndefined. prefix starts each message (_checks.check_like's).
void check_like(const at::Tensor& t, const at::Tensor& ref, const char* what, size_t i, const char* ref_what,
                at::ScalarType dtype, const char* prefix = "fastops: ") {
  TORCH_CHECK(t.sizes() == ref.sizes(), prefix, what, "[", i, "] has shape ", py_tuple(t.sizes()), " but ",
              ref_what, "[", i, "] has shape ", py_tuple(ref.sizes()));
  const at::ScalarType want = dtype == at::ScalarType::Undefined ? ref.scalar_type() : dtype;
  TORCH_CHECK(t.scalar_type() == want, prefix, what, "[", i, "] has dtype ", py_dtype(t.scalar_type()),
              " but must be ", py_dtype(want), " (as ", ref_what, "[", i, "])");
  TORCH_CHECK(t.device() == ref.device(), prefix, what, "[", i, "] is on ", t.device().str(), " but ", ref_what,
              "[", i, "] is on ", ref.device().str());
  TORCH_CHECK(t.numel() <= 1 || t.strides() == ref.strides(), prefix, what, "[", i, "] has strides ",
              py_tuple(t.strides()), " but ", ref_what, "[", i, "] has strides ", py_tuple(ref.strides()));
}

std::string indexed(const char* name, size_t i) { return std::string(name) + "[" + std::to_string(i) + "]"; }

inline bool dense_fast(const at::Tensor& t) {
  return t.layout() == at::kStrided && !t.is_complex() && (t.is_contiguous() || t.is_non_overlapping_and_dense());
}

struct Named {
  const char* name;
  const std::vector<at::Tensor>* list;  // null: not part of this call (amsgrad off, no master params)
  bool fp32_state;                      // one fp32 tensor per param, shaped and strided like it
};

// _checks._check_per_param: the list lengths, then per param its dtype and device, its grad, its fp32 states.
void check_per_param(const char* op, const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                     std::initializer_list<Named> lists) {
  const size_t n = params.size();
  for (const auto& l : lists) {
    if (l.list == nullptr) continue;
    TORCH_CHECK(l.list->size() == n, "fastops.", op, ": expected ", n, " ", l.name, " (one per param), got ",
                l.list->size());
  }
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    // check_dense builds its `what` string eagerly; skip it on the fast path.
    if (!dense_fast(p)) check_dense(p, indexed("params", i));
    TORCH_CHECK(is_float(p.scalar_type()), "fastops.", op, ": params[", i, "] has dtype ", py_dtype(p.scalar_type()),
                "; expected float32, bfloat16 or float16");
    TORCH_CHECK(p.device() == params[0].device(), "fastops.", op, ": params[", i, "] is on ", p.device().str(),
                " but params[0] is on ", params[0].device().str());
    const at::Tensor& g = grads[i];
    if (!dense_fast(g)) check_dense(g, indexed("grads", i));
    check_like(g, p, "grads", i, "params", at::ScalarType::Undefined);
    for (const auto& l : lists) {
      if (l.list != nullptr && l.fp32_state) check_like((*l.list)[i], p, l.name, i, "params", at::kFloat);
    }
  }
}

}  // namespace

void check_adam_args(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                     const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                     const std::vector<at::Tensor>& max_exp_avg_sqs, const std::vector<at::Tensor>& state_steps,
                     const std::vector<at::Tensor>& master_params, bool amsgrad) {
  TORCH_CHECK(amsgrad || max_exp_avg_sqs.empty(),
              "fastops.adam_step_: max_exp_avg_sqs must be empty when amsgrad=False");
  // Same order as the dict in _checks.check_adam_args.
  check_per_param("adam_step_", params, grads,
                  {{"grads", &grads, false},
                   {"exp_avgs", &exp_avgs, true},
                   {"exp_avg_sqs", &exp_avg_sqs, true},
                   {"state_steps", &state_steps, false},
                   {"max_exp_avg_sqs", amsgrad ? &max_exp_avg_sqs : nullptr, true},
                   {"master_params", master_params.empty() ? nullptr : &master_params, true}});
  for (size_t i = 0; i < state_steps.size(); ++i) {
    const at::Tensor& s = state_steps[i];
    TORCH_CHECK(s.numel() == 1 && s.scalar_type() == at::kFloat, "fastops.adam_step_: state_steps[", i,
                "] must be a float32 tensor with one element");
  }
}

void check_adam_lowp_args(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                          const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                          const std::vector<at::Tensor>& exp_avg_absmax, const std::vector<at::Tensor>& exp_avg_sq_absmax,
                          const std::vector<at::Tensor>& state_steps, const std::vector<at::Tensor>& master_params) {
  constexpr const char* op = "fastops.adam_step_lowp_";
  // Same order as the dict in _checks.check_adam_lowp_args; only the master weights are fp32 like the param.
  check_per_param("adam_step_lowp_", params, grads,
                  {{"grads", &grads, false},
                   {"exp_avgs", &exp_avgs, false},
                   {"exp_avg_sqs", &exp_avg_sqs, false},
                   {"state_steps", &state_steps, false},
                   {"master_params", master_params.empty() ? nullptr : &master_params, true}});
  const at::ScalarType state_dtype = exp_avgs.empty() ? at::kByte : exp_avgs[0].scalar_type();
  TORCH_CHECK(state_dtype == at::kByte || state_dtype == at::kBFloat16, op, ": exp_avgs[0] has dtype ",
              py_dtype(state_dtype), "; expected uint8 (8-bit states) or bfloat16");
  const bool eight_bit = state_dtype == at::kByte;
  const std::string prefix = std::string(op) + ": ";
  for (size_t i = 0; i < exp_avgs.size(); ++i)
    check_like(exp_avgs[i], params[i], "exp_avgs", i, "params", state_dtype, prefix.c_str());
  for (size_t i = 0; i < exp_avg_sqs.size(); ++i)
    check_like(exp_avg_sqs[i], params[i], "exp_avg_sqs", i, "params", state_dtype, prefix.c_str());
  for (size_t i = 0; i < state_steps.size(); ++i) {
    const at::Tensor& s = state_steps[i];
    TORCH_CHECK(s.numel() == 1 && s.scalar_type() == at::kFloat, op, ": state_steps[", i,
                "] must be a float32 tensor with one element");
  }
  for (const auto& [name, lst] : {std::pair{"exp_avg_absmax", &exp_avg_absmax},
                                  std::pair{"exp_avg_sq_absmax", &exp_avg_sq_absmax}}) {
    if (!eight_bit) {
      TORCH_CHECK(lst->empty(), op, ": ", name, " must be empty with bfloat16 states");
      continue;
    }
    TORCH_CHECK(lst->size() == params.size(), op, ": expected ", params.size(), " ", name,
                " (one per param), got ", lst->size());
    for (size_t i = 0; i < lst->size(); ++i) {
      const at::Tensor& a = (*lst)[i];
      const int64_t blocks = (params[i].numel() + 255) / 256;
      TORCH_CHECK(a.scalar_type() == at::kFloat && a.device() == params[i].device() && a.dim() == 1 &&
                      a.numel() == blocks && a.is_contiguous(),
                  op, ": ", name, "[", i, "] must be a contiguous 1-D float32 tensor of ", blocks,
                  " elements (one per 256 of params[", i, "]) on ", params[i].device().str(), ", got ",
                  py_dtype(a.scalar_type()), " of shape ", py_tuple(a.sizes()), " on ", a.device().str());
    }
  }
}

void check_sgd_args(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                    const std::vector<at::Tensor>& momentum_buffers, const std::vector<at::Tensor>& master_params,
                    double momentum) {
  TORCH_CHECK(momentum != 0 || momentum_buffers.empty(),
              "fastops.sgd_step_: momentum_buffers must be empty when momentum=0");
  // Same order as the dict in _checks.check_sgd_args.
  check_per_param("sgd_step_", params, grads,
                  {{"grads", &grads, false},
                   {"momentum_buffers", momentum != 0 ? &momentum_buffers : nullptr, true},
                   {"master_params", master_params.empty() ? nullptr : &master_params, true}});
}

void check_grads(const std::vector<at::Tensor>& grads, const char* op) {
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& g = grads[i];
    if (!dense_fast(g)) check_dense(g, indexed("grads", i));
    TORCH_CHECK(is_float(g.scalar_type()), "fastops.", op, ": grads[", i, "] has dtype ", py_dtype(g.scalar_type()),
                "; expected float32, bfloat16 or float16");
    TORCH_CHECK(g.device() == grads[0].device(), "fastops.", op, ": grads[", i, "] is on ", g.device().str(),
                " but grads[0] is on ", grads[0].device().str());
  }
}

void check_scalar(const at::Tensor& t, const char* op, const char* what, const at::Device& device) {
  TORCH_CHECK(t.numel() == 1 && at::isFloatingType(t.scalar_type()), "fastops.", op, ": ", what,
              " must be a floating tensor with one element, got ", py_dtype(t.scalar_type()), " of shape ",
              py_tuple(t.sizes()));
  TORCH_CHECK(t.device() == device || t.is_cpu(), "fastops.", op, ": ", what, " is on ", t.device().str(),
              " but the tensors are on ", device.str(), "; pass it on ", device.str(), " or the CPU");
}

void check_found_inf(const at::Tensor& found_inf, const char* op, const at::Device& device) {
  TORCH_CHECK(found_inf.numel() == 1 && found_inf.scalar_type() == at::kFloat && found_inf.device() == device,
              "fastops.", op, ": found_inf must be one float32 element on ", device.str(),
              " (the kernel writes it), got ", py_dtype(found_inf.scalar_type()), " of shape ",
              py_tuple(found_inf.sizes()), " on ", found_inf.device().str());
}

}  // namespace fastops

// The op-boundary check of each op (fastops/_ops.py's dispatcher kernel calls it when fastops._C loads), with the
// op's own arguments: the list checks above, then the tensor scalars, in fastops/_specs' order. The float
// hyperparameters are checked in Python (a few compares). Registered as torch ops, torch.ops.fastops_checks.*.
namespace {
using TL = std::vector<at::Tensor>;
using OptT = std::optional<at::Tensor>;

void check_scalars(const char* op, const TL& params, const at::Tensor& lr, const OptT& grad_scale,
                   const OptT& found_inf) {
  if (params.empty()) return;
  const at::Device device = params[0].device();
  fastops::check_scalar(lr, op, "lr", device);
  if (grad_scale.has_value()) fastops::check_scalar(*grad_scale, op, "grad_scale", device);
  if (found_inf.has_value()) fastops::check_scalar(*found_inf, op, "found_inf", device);
}
}  // namespace

TORCH_LIBRARY(fastops_checks, m) {
  m.def("adam_step_(Tensor[] params, Tensor[] grads, Tensor[] exp_avgs, Tensor[] exp_avg_sqs, "
        "Tensor[] max_exp_avg_sqs, Tensor[] state_steps, Tensor[] master_params, Tensor lr, float beta1, "
        "float beta2, float eps, float weight_decay, bool amsgrad, bool maximize, bool decoupled, "
        "Tensor? grad_scale, Tensor? found_inf) -> ()",
        [](const TL& p, const TL& g, const TL& m1, const TL& m2, const TL& mx, const TL& st, const TL& mp,
           const at::Tensor& lr, double, double, double, double, bool amsgrad, bool, bool, const OptT& gs,
           const OptT& fi) {
          fastops::check_adam_args(p, g, m1, m2, mx, st, mp, amsgrad);
          check_scalars("adam_step_", p, lr, gs, fi);
        });
  m.def("adam_step_lowp_(Tensor[] params, Tensor[] grads, Tensor[] exp_avgs, Tensor[] exp_avg_sqs, "
        "Tensor[] exp_avg_absmax, Tensor[] exp_avg_sq_absmax, Tensor[] state_steps, Tensor[] master_params, "
        "Tensor lr, float beta1, float beta2, float eps, float weight_decay, bool maximize, bool decoupled, "
        "SymInt seed, Tensor? grad_scale, Tensor? found_inf) -> ()",
        [](const TL& p, const TL& g, const TL& m1, const TL& m2, const TL& a1, const TL& a2, const TL& st,
           const TL& mp, const at::Tensor& lr, double, double, double, double, bool, bool, int64_t, const OptT& gs,
           const OptT& fi) {
          fastops::check_adam_lowp_args(p, g, m1, m2, a1, a2, st, mp);
          check_scalars("adam_step_lowp_", p, lr, gs, fi);
        });
  m.def("sgd_step_(Tensor[] params, Tensor[] grads, Tensor[] momentum_buffers, Tensor[] master_params, Tensor lr, "
        "float weight_decay, float momentum, float dampening, bool nesterov, bool maximize, bool is_first_step, "
        "Tensor? grad_scale, Tensor? found_inf) -> ()",
        [](const TL& p, const TL& g, const TL& b, const TL& mp, const at::Tensor& lr, double, double momentum, double,
           bool, bool, bool, const OptT& gs, const OptT& fi) {
          fastops::check_sgd_args(p, g, b, mp, momentum);
          check_scalars("sgd_step_", p, lr, gs, fi);
        });
  m.def("unscale_check_(Tensor[] grads, Tensor found_inf, Tensor inv_scale) -> ()",
        [](const TL& g, const at::Tensor& found_inf, const at::Tensor& inv_scale) {
          fastops::check_grads(g, "unscale_check_");
          if (g.empty()) return;
          fastops::check_found_inf(found_inf, "unscale_check_", g[0].device());
          fastops::check_scalar(inv_scale, "unscale_check_", "inv_scale", g[0].device());
        });
  m.def("grad_stats(Tensor[] grads, Tensor? inv_scale=None) -> ()", [](const TL& g, const OptT& inv_scale) {
    TORCH_CHECK(!g.empty(), "fastops.grad_stats: needs at least one tensor");
    fastops::check_grads(g, "grad_stats");
    if (inv_scale.has_value()) fastops::check_scalar(*inv_scale, "grad_stats", "inv_scale", g[0].device());
  });
}
