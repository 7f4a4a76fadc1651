// Kernel bodies, compiled once per ISA: each kernels_<isa>.cpp includes the standard headers, then sets
// `#pragma GCC target(...)`, defines FASTOPS_ISA_NS / FASTOPS_ISA_TABLE / FASTOPS_ISA_NAME and includes this
// file, so every function here gets that ISA and lives in its own namespace (no symbol is shared between
// the copies). This file only opens that namespace and includes the kernels' parts inside it, in this order:
//   access_isa.h   bit casts, fmadd, bf16/fp16 conversions, the optimizers' param/grad access (for_each_block)
//   sr_isa.h       the stochastic-rounding stream of bf16 states
//   codec_isa.h    the 8-bit state codec
//   adam_isa.h     adam_step_ and adam_step_lowp_
//   sgd_amp_isa.h  sgd_step_, the AMP unscale + non-finite check, grad_stats
//   dropout_isa.h  dropout's mask and scale
//
// The loops are plain C++ with `#pragma omp simd`, vectorised by GCC for the target of the enclosing
// pragma. Measured here (32M fp32 params in 128 tensors, 2 threads): the loop runs at memory bandwidth
// with any of the three ISAs once -fno-math-errno lets sqrt vectorise, so there is nothing to gain from
// intrinsics except for fp16 conversion, which GCC 12 does not vectorise from `_Float16` with only F16C.

// The ISA features are passed in as FASTOPS_HAVE_* (0/1) rather than read from __AVX512F__ and friends:
// in C++, GCC's `#pragma GCC target` changes code generation but not those predefined macros.

#if !defined(FASTOPS_ISA_NS) || !defined(FASTOPS_HAVE_FMA) || !defined(FASTOPS_HAVE_F16C) || \
    !defined(FASTOPS_HAVE_AVX512) || !defined(FASTOPS_HAVE_AVX2)
#error "define FASTOPS_ISA_NS and FASTOPS_HAVE_{FMA,F16C,AVX2,AVX512} before including kernels_isa.h"
#endif

namespace fastops {
namespace cpu {
namespace FASTOPS_ISA_NS {
namespace {

#include "access_isa.h"
#include "sr_isa.h"
#include "codec_isa.h"
#include "adam_isa.h"
#include "sgd_amp_isa.h"
#include "dropout_isa.h"

}  // namespace
}  // namespace FASTOPS_ISA_NS

extern const KernelTable FASTOPS_ISA_TABLE = {FASTOPS_ISA_NAME, &FASTOPS_ISA_NS::adam, &FASTOPS_ISA_NS::sgd,
                                              &FASTOPS_ISA_NS::unscale, &FASTOPS_ISA_NS::stats,
                                              &FASTOPS_ISA_NS::adam_lowp, &FASTOPS_ISA_NS::dropout};

}  // namespace cpu
}  // namespace fastops
