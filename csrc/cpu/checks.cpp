// The ops' argument checks, check(const <Op>Args&) of csrc/generated/op_args.h: fastops/_checks.py's conditions in its
// order with its messages (tests/test_bad_input.py holds both to the specs' messages). The generated bindings run
// them in the call that runs the kernel, or alone for the backends written in Python (fastops._C.checks). The messages
// spell shapes, strides, dtypes and devices the way Python prints them ("(4,)", "torch.float32", "cuda:0"); they are
// built only when a check fails.
#include <cctype>
#include <initializer_list>
#include <utility>
#include <optional>
#include <sstream>
#include <string>

#include <c10/util/Exception.h>

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
  const TensorList* list;  // null: not part of this call (amsgrad off, no master params)
  bool fp32_state;         // one fp32 tensor per param, shaped and strided like it
};

// _checks._floats: every tensor of ts dense, of a float dtype, and on ts[0]'s device.
void check_floats(const TensorList& ts, const char* name, const char* op) {
  for (size_t i = 0; i < ts.size(); ++i) {
    const at::Tensor& t = ts[i];
    // check_dense builds its `what` string eagerly; skip it on the fast path.
    if (!dense_fast(t)) check_dense(t, indexed(name, i));
    TORCH_CHECK(is_float(t.scalar_type()), "fastops.", op, ": ", name, "[", i, "] has dtype ",
                py_dtype(t.scalar_type()), "; expected float32, bfloat16 or float16");
    TORCH_CHECK(t.device() == ts[0].device(), "fastops.", op, ": ", name, "[", i, "] is on ", t.device().str(), " but ",
                name, "[0] is on ", ts[0].device().str());
  }
}

// _checks._per_param: the list lengths, the params, then per param its grad and its fp32 states.
void per_param(const char* op, const TensorList& params, const TensorList& grads, std::initializer_list<Named> lists) {
  const size_t n = params.size();
  for (const auto& l : lists) {
    if (l.list == nullptr) continue;
    TORCH_CHECK(l.list->size() == n, "fastops.", op, ": expected ", n, " ", l.name, " (one per param), got ",
                l.list->size());
  }
  check_floats(params, "params", op);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    const at::Tensor& g = grads[i];
    if (!dense_fast(g)) check_dense(g, indexed("grads", i));
    check_like(g, p, "grads", i, "params", at::ScalarType::Undefined);
    for (const auto& l : lists) {
      if (l.list != nullptr && l.fp32_state) check_like((*l.list)[i], p, l.name, i, "params", at::kFloat);
    }
  }
}

// _checks._steps: one float32 element each, on the params' device (the kernels bump and read them there).
void check_steps(const char* op, const TensorList& steps, const TensorList& params) {
  for (size_t i = 0; i < steps.size(); ++i) {
    const at::Tensor& s = steps[i];
    TORCH_CHECK(s.numel() == 1 && s.scalar_type() == at::kFloat, "fastops.", op, ": state_steps[", i,
                "] must be a float32 tensor with one element");
    TORCH_CHECK(s.device() == params[0].device(), "fastops.", op, ": state_steps[", i, "] is on ", s.device().str(),
                " but params[0] is on ", params[0].device().str(),
                "; the kernels read each step on the params' device");
  }
}

// _checks.check_scalar: a one-element floating tensor on `device` or the CPU (read through a pointer or on the host).
void check_scalar(const at::Tensor& t, const char* op, const char* what, const at::Device& device) {
  TORCH_CHECK(t.numel() == 1 && at::isFloatingType(t.scalar_type()), "fastops.", op, ": ", what,
              " must be a floating tensor with one element, got ", py_dtype(t.scalar_type()), " of shape ",
              py_tuple(t.sizes()));
  TORCH_CHECK(t.device() == device || t.is_cpu(), "fastops.", op, ": ", what, " is on ", t.device().str(),
              " but the tensors are on ", device.str(), "; pass it on ", device.str(), " or the CPU");
}

void check_scalar(const OptionalTensor& t, const char* op, const char* what, const at::Device& device) {
  if (t.has_value()) check_scalar(*t, op, what, device);
}

// _checks._step_scalars: lr, grad_scale and found_inf of an optimizer step.
template <class Args>
void check_step_scalars(const char* op, const Args& a) {
  if (a.params.empty()) return;
  const at::Device device = a.params[0].device();
  check_scalar(a.lr, op, "lr", device);
  check_scalar(a.grad_scale, op, "grad_scale", device);
  check_scalar(a.found_inf, op, "found_inf", device);
}

}  // namespace

std::optional<StateFormat> state_format(const TensorList& exp_avgs) {
  switch (exp_avgs.empty() ? at::kByte : exp_avgs[0].scalar_type()) {
    case at::kFloat: return StateFormat::kFp32;
    case at::kBFloat16: return StateFormat::kBf16;
    case at::kByte: return StateFormat::kEightBit;
    default: return std::nullopt;
  }
}

void check(const AdamStepArgs& a) {
  constexpr const char* op = "adam_step_";
  TORCH_CHECK(a.amsgrad || a.max_exp_avg_sqs.empty(),
              "fastops.adam_step_: max_exp_avg_sqs must be empty when amsgrad=False");
  // Same order as the dict in _checks.adam_step_.
  per_param(op, a.params, a.grads,
            {{"grads", &a.grads, false},
             {"exp_avgs", &a.exp_avgs, true},
             {"exp_avg_sqs", &a.exp_avg_sqs, true},
             {"state_steps", &a.state_steps, false},
             {"max_exp_avg_sqs", a.amsgrad ? &a.max_exp_avg_sqs : nullptr, true},
             {"master_params", a.master_params.empty() ? nullptr : &a.master_params, true}});
  check_steps(op, a.state_steps, a.params);
  check_step_scalars(op, a);
}

void check(const AdamStepLowpArgs& a) {
  constexpr const char* op = "adam_step_lowp_";
  const std::string prefix = std::string("fastops.") + op + ": ";
  // Same order as the dict in _checks.adam_step_lowp_; only the master weights are fp32 like the param.
  per_param(op, a.params, a.grads,
            {{"grads", &a.grads, false},
             {"exp_avgs", &a.exp_avgs, false},
             {"exp_avg_sqs", &a.exp_avg_sqs, false},
             {"state_steps", &a.state_steps, false},
             {"master_params", a.master_params.empty() ? nullptr : &a.master_params, true}});
  const std::optional<StateFormat> format = state_format(a.exp_avgs);
  TORCH_CHECK(format == StateFormat::kEightBit || format == StateFormat::kBf16, prefix, "exp_avgs[0] has dtype ",
              py_dtype(a.exp_avgs[0].scalar_type()), "; expected uint8 (8-bit states) or bfloat16");
  const at::ScalarType dtype = format == StateFormat::kEightBit ? at::kByte : at::kBFloat16;
  for (const auto& [name, list] : {std::pair{"exp_avgs", &a.exp_avgs}, std::pair{"exp_avg_sqs", &a.exp_avg_sqs}}) {
    for (size_t i = 0; i < list->size(); ++i) {
      check_like((*list)[i], a.params[i], name, i, "params", dtype, prefix.c_str());
    }
  }
  check_steps(op, a.state_steps, a.params);
  for (const auto& [name, list] : {std::pair{"exp_avg_absmax", &a.exp_avg_absmax},
                                   std::pair{"exp_avg_sq_absmax", &a.exp_avg_sq_absmax}}) {
    if (format == StateFormat::kBf16) {
      TORCH_CHECK(list->empty(), prefix, name, " must be empty with bfloat16 states");
      continue;
    }
    TORCH_CHECK(list->size() == a.params.size(), prefix, "expected ", a.params.size(), " ", name,
                " (one per param), got ", list->size());
    for (size_t i = 0; i < list->size(); ++i) {
      const at::Tensor& t = (*list)[i];
      const at::Tensor& p = a.params[i];
      const int64_t blocks = (p.numel() + 255) / 256;
      TORCH_CHECK(t.scalar_type() == at::kFloat && t.device() == p.device() && t.dim() == 1 && t.numel() == blocks &&
                      t.is_contiguous(),
                  prefix, name, "[", i, "] must be a contiguous 1-D float32 tensor of ", blocks,
                  " elements (one per 256 of params[", i, "]) on ", p.device().str(), ", got ",
                  py_dtype(t.scalar_type()), " of shape ", py_tuple(t.sizes()), " on ", t.device().str());
    }
  }
  check_step_scalars(op, a);
}

void check(const SgdStepArgs& a) {
  constexpr const char* op = "sgd_step_";
  TORCH_CHECK(a.momentum != 0 || a.momentum_buffers.empty(),
              "fastops.sgd_step_: momentum_buffers must be empty when momentum=0");
  // Same order as the dict in _checks.sgd_step_.
  per_param(op, a.params, a.grads,
            {{"grads", &a.grads, false},
             {"momentum_buffers", a.momentum != 0 ? &a.momentum_buffers : nullptr, true},
             {"master_params", a.master_params.empty() ? nullptr : &a.master_params, true}});
  check_step_scalars(op, a);
}

void check(const UnscaleCheckArgs& a) {
  constexpr const char* op = "unscale_check_";
  check_floats(a.grads, "grads", op);
  if (a.grads.empty()) return;
  const at::Device device = a.grads[0].device();
  const at::Tensor& f = a.found_inf;
  // The kernels write 1.0 into it.
  TORCH_CHECK(f.numel() == 1 && f.scalar_type() == at::kFloat && f.device() == device, "fastops.", op,
              ": found_inf must be one float32 element on ", device.str(), " (the kernel writes it), got ",
              py_dtype(f.scalar_type()), " of shape ", py_tuple(f.sizes()), " on ", f.device().str());
  check_scalar(a.inv_scale, op, "inv_scale", device);
}

void check(const DropoutArgs& a) {
  if (!dense_fast(a.x)) check_dense(a.x, "x");
  TORCH_CHECK(is_float(a.x.scalar_type()), "fastops.dropout: x has dtype ", py_dtype(a.x.scalar_type()),
              "; expected float32, bfloat16 or float16");
}

void check(const GradStatsArgs& a) {
  constexpr const char* op = "grad_stats";
  TORCH_CHECK(!a.grads.empty(), "fastops.", op, ": needs at least one tensor");
  check_floats(a.grads, "grads", op);
  check_scalar(a.inv_scale, op, "inv_scale", a.grads[0].device());
}

}  // namespace fastops
