// The boundary between the host code (adam.cpp, amp.cpp: argument checks, step counters, work split) and
// the per-ISA kernel bodies (kernels_isa.h, compiled once per ISA by kernels_{default,avx2,avx512}.cpp).
// Only raw pointers and plain scalars cross it, so the ISA translation units include no torch headers:
// an inline torch function compiled for AVX-512 there could be picked by the linker for the whole library.
#pragma once

#include <cstdint>

#include "state_format.h"

namespace fastops {
namespace cpu {

enum class Dtype : int8_t { kFloat = 0, kBFloat16 = 1, kHalf = 2 };

// How an optimizer kernel turns the stored grad into the one it uses: g / div with a grad_scale (div is the
// scale, negated under maximize: -(g / s) == g / (-s) exactly), else g * sign (-1 under maximize).
struct GradScaling {
  float div;
  float sign;
  bool has_scale;
};

// Scalars of one adam_step_ call, already cast to fp32 the way torch's CPU ops cast Python scalars.
struct AdamConsts {
  float lerp_weight;        // 1 - beta1
  float lerp_weight_m1;     // (1 - beta1) - 1, the coefficient of torch's lerp for weight >= 0.5
  bool lerp_low;            // |1 - beta1| < 0.5: lerp computes m + w*(g - m), else g - (g - m)*(1 - w)
  float beta2;
  float one_minus_beta2;
  float eps;
  float weight_decay;       // L2 (decoupled=false) coefficient; the kernel adds it only when l2 is set
  float decay;              // 1 - lr*wd when decoupled, else 1 (p*1 is exact, so it is always applied)
  GradScaling grad;
  bool l2;
  bool amsgrad;
};

// One tensor of an adam_step_ call. grad has the param's dtype; the states and master are fp32.
struct AdamTensor {
  void* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;  // null unless amsgrad
  float* master;          // null when there are no master weights
  int64_t numel;
  Dtype dtype;
  float neg_step_size;    // -(lr / (1 - beta1^step)), rounded to fp32 like addcdiv_'s value
  float bc2_sqrt;         // sqrt(1 - beta2^step), rounded to fp32 like the divisor of sqrt(v)
};

// Scalars of one sgd_step_ call, cast to fp32 as torch's CPU ops cast Python scalars.
struct SgdConsts {
  float neg_lr;               // -lr, the alpha of p.add_(grad, alpha=-lr)
  float weight_decay;         // used when wd
  float momentum;
  float one_minus_dampening;  // fp32(1 - dampening in fp64), as torch passes alpha=1 - dampening
  GradScaling grad;
  bool wd;                    // weight_decay != 0
  int mom;                    // 0: no momentum, 1: first step (buf = grad), 2: buf = momentum*buf + (1-d)*grad
  bool nesterov;              // only with mom != 0
};

// One tensor of an sgd_step_ call. grad has the param's dtype; buf and master are fp32.
struct SgdTensor {
  void* param;
  const void* grad;
  float* buf;     // null without momentum
  float* master;  // null when there are no master weights
  int64_t numel;
  Dtype dtype;
};

// Reduction partials of grad_stats over a range: sum of squares of the unscaled grads (fp32 within blocks, blocks
// added in double) and the largest |x| of the grads as they are, as bits (IEEE order of non-negative floats is integer
// order, and every inf/nan compares above 0x7f800000 - 1, so the same max gives max|g|, nan propagation and
// found_inf).
struct StatsPartial {
  double sumsq;
  uint32_t max_abs_bits;
};

// The fp32 constants of one 8-bit map, as fastops/_quant.py defines them (built once on the host, in
// adam_lowp.cpp). P, F and n hold 7 decades padded to 8 lanes so that one vpermps looks a decade's value up.
struct QuantMap {
  float qmap[256];  // code -> value
  float T[8];       // T[0]: below it, code 0; T[1..6]: decade boundaries; T[7]: from it, the top code
  float P[8];       // 10^(6 - i)
  float F[8];       // n_i / 0.9
  int32_t n[8];     // fractions in decade i
};

// The two maps (exp_avg's signed, exp_avg_sq's unsigned), built on first use (adam_lowp.cpp).
const QuantMap& quant_map(bool is_signed);

// Scalars of one adam_step_lowp_ call: adam_step_'s (amsgrad off) and the state format (kEightBit or kBf16; the 8-bit
// maps: quant_map()).
struct LowpConsts {
  AdamConsts adam;
  StateFormat format;
};

// One tensor of an adam_step_lowp_ call. Ranges handed to the kernel start on a multiple of 256 elements
// (the 8-bit block), so a block is never split between threads.
struct LowpTensor {
  void* param;
  const void* grad;
  void* exp_avg;             // uint8 codes or bf16 bits, laid out like the param
  void* exp_avg_sq;
  float* exp_avg_absmax;     // 8-bit only: one per 256 elements
  float* exp_avg_sq_absmax;
  float* master;             // null when there are no master weights
  int64_t numel;
  Dtype dtype;
  float neg_step_size;
  float bc2_sqrt;
  uint32_t sr_key;           // bf16 only: _quant.sr_key(seed, index of the tensor)
};

struct KernelTable {
  const char* name;
  // Updates elements [begin, end) of tensor t.
  void (*adam)(const AdamTensor& t, const AdamConsts& c, int64_t begin, int64_t end);
  void (*sgd)(const SgdTensor& t, const SgdConsts& c, int64_t begin, int64_t end);
  // g[i] *= inv_scale for i in [0, n) when write; returns whether any element was inf or nan (read before
  // scaling, as torch's kernel checks them).
  bool (*unscale)(void* g, Dtype dt, int64_t n, float inv_scale, bool write);
  // Adds [0, n) of g * inv_scale into *acc (the max |x| bits are of g itself, for the inf/nan check).
  void (*stats)(const void* g, Dtype dt, int64_t n, float inv_scale, StatsPartial* acc);
  // Updates elements [begin, end) of tensor t; begin is a multiple of 256.
  void (*adam_lowp)(const LowpTensor& t, const LowpConsts& c, int64_t begin, int64_t end);
  // dropout's elements [k0, k0 + n) of x into out (both offset to element k0 already); k0 is a multiple of 256.
  void (*dropout)(const void* x, void* out, Dtype dt, int64_t k0, int64_t n, uint32_t key, uint32_t threshold,
                  float scale);
};

extern const KernelTable kTableDefault;
// The AVX2/AVX-512 copies are built only on top of a pre-AVX2 baseline: with -march=native (FASTOPS_NATIVE=1)
// the baseline copy already has every ISA of the machine, and GCC refuses to inline the intrinsics, which
// are then compiled for the full native ISA, into a function targeted at a narrower one.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__AVX2__)
#define FASTOPS_MULTI_ISA 1
extern const KernelTable kTableAvx2;
extern const KernelTable kTableAvx512;
extern const KernelTable kTableAvx512Vbmi;
#endif

// The table chosen at load time for this CPU (FASTOPS_CPU_CAPABILITY=default|avx2|avx512|avx512_vbmi lowers it).
const KernelTable& kernels();

}  // namespace cpu
}  // namespace fastops
