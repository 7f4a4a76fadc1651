// What the generated bindings (csrc/generated/op_bindings.h) are made of: def_op defines one op as a pybind11 function
// of its arguments by name, gathered into the op's argument struct (csrc/generated/op_args.h), checked, run, and its
// written tensors' version counters bumped: the whole op boundary in one call from Python.
#pragma once

#include <type_traits>

#include <torch/csrc/autograd/variable.h>
#include <torch/extension.h>

namespace fastops {
namespace py = pybind11;

// The arguments' C++ types, for def_op.
template <class... Ts>
struct Params {};

// The kernel of a check alone (def_checks): nothing runs after the check, no version counter moves.
struct CheckOnly {};

// The autograd version counter of each tensor an op writes, bumped as torch's in-place ops bump theirs (a tensor made
// under inference_mode has none): fastops.optim's master weights rely on a param written through its master looking
// modified. Here, not in fastops/_ops.py, for the C++ backends: 1800 bumps from Python took ~90 us a call at 300
// params (15 us a list of 300), in C++ they are an atomic increment each.
inline void bump_one(const at::Tensor& t) {
  if (!t.is_inference()) torch::autograd::impl::bump_version(t);
}
inline void bump_one(const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts) bump_one(t);
}
template <class... Ts>
void bump_version(const Ts&... ts) {
  (bump_one(ts), ...);
}

// Defines `name` on m: a function of the op's arguments (types Ts, names and defaults in `names`) that gathers them
// into Args, runs check(args) (csrc/cpu/checks.cpp), then returns kernel(args) after bump_versions(args), without the
// GIL. So a call from Python crosses into C++ once, for the whole op.
template <class Args, class Kernel, class... Ts, class... Names>
void def_op(py::module_ m, const char* name, Kernel kernel, Params<Ts...>, const Names&... names) {
  m.def(
      name,
      [kernel](Ts... ts) {
        const Args a{ts...};
        check(a);
        if constexpr (std::is_same_v<Kernel, CheckOnly>) {
          return;
        } else if constexpr (std::is_void_v<std::invoke_result_t<Kernel, const Args&>>) {
          kernel(a);
          bump_versions(a);
        } else {
          auto out = kernel(a);
          bump_versions(a);
          return out;
        }
      },
      names..., py::call_guard<py::gil_scoped_release>());
}

}  // namespace fastops
