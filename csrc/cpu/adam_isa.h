// Adam's kernels, compiled once per ISA: adam_step_ on fp32 states and adam_step_lowp_ on 8-bit or bf16 states.
// Included by kernels_isa.h inside its FASTOPS_ISA_NS anonymous namespace, after access_isa.h, sr_isa.h and
// codec_isa.h; includes nothing itself.

// ---- Adam ---------------------------------------------------------------------------------------------
// Per element, the operations, their order and their FMAs are those of fastops.reference.adam_step_
// (torch's for-loop Adam) as torch's vectorised CPU kernels compute them: add(alpha) = fma(p, wd, g),
// lerp_ = fma(coeff, g - m, base), mul_ then addcmul_ = fma((1-beta2)*g, g, v*beta2), sqrt / bc2_sqrt + eps,
// addcdiv_ = p + (-step_size*m) / denom. Measured on AVX-512/AVX2 (1M params, 5 steps): m and v match the
// reference bit for bit, p in all but ~0.03% of elements per step, which are 1 ulp off because torch's
// sqrt_ goes through MKL's vsSqrt (not correctly rounded) while sqrtps is. Without FMA (default ISA) the
// results differ from the reference by rounding, as torch's own default-capability kernels would.
//
// kBf16: m and v are bf16 states (adam_step_lowp_), widened on load and written back with stochastic rounding in
// the same loop, so that a bf16 step makes the one pass over memory an fp32 step makes: element i is element
// k0 + i of a tensor whose stream key is sr_key. Else they are fp32 and sr_key, k0 are unused.
// kLerp: which of torch's two lerp formulas, or kLerpMask: the one c.lerp_low picks, per element.
constexpr int kLerpMask = 0, kLerpLow = 1, kLerpHigh = 2;

// bf16: a software prefetch of the lines the block kPrefetchAhead elements on touches (p, g, m, v), issued a block
// at a time outside the vectorised loop. At 1 thread the step is near its compute bound (3 divider ops an element:
// 0.84 ns/param in L2) as well as its memory one, and the hardware prefetchers stop at each 4 KiB page; measured
// on Emerald Rapids, 1 thread, CPU time, load 6-7, three alternating runs each: 24M params 1.16-1.23x torch
// fused=True without, 1.28-1.29x with (16M: 1.12-1.19x, 1.03-1.28x). fp32 states are left as they were.
constexpr int64_t kPrefetchAhead = 2048;
template <int kKind>
inline void prefetch_ahead(const void* p, const void* g, const uint16_t* m16, const uint16_t* v16, int64_t lo,
                           int64_t hi) {
  constexpr int64_t ps = kKind == kBF16 ? 2 : 4, gs = (kKind == kBF16 || kKind == kBF16Master) ? 2 : 4;
  for (int64_t b = lo * ps; b < hi * ps; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b, 1);
  for (int64_t b = lo * gs; b < hi * gs; b += 64) __builtin_prefetch(static_cast<const char*>(g) + b, 0);
  for (int64_t b = lo * 2; b < hi * 2; b += 64) {
    __builtin_prefetch(reinterpret_cast<const char*>(m16) + b, 1);
    __builtin_prefetch(reinterpret_cast<const char*>(v16) + b, 1);
  }
}

#if FASTOPS_HAVE_AVX2 && !FASTOPS_HAVE_AVX512
#include "adam_bf16_avx2.h"
#endif

template <int kKind, bool kAms, bool kL2, bool kScale, bool kBf16 = false, int kLerp = kLerpMask>
void adam_math(void* __restrict pv, const void* __restrict gv, void* __restrict mv, void* __restrict vv,
               float* __restrict vmax, void* __restrict outv, int64_t n, const AdamConsts& c, float neg_step_size,
               float bc2_sqrt, uint32_t sr_key = 0, int64_t k0 = 0) {
  float* __restrict const m = static_cast<float*>(mv);
  float* __restrict const v = static_cast<float*>(vv);
  uint16_t* __restrict const m16 = static_cast<uint16_t*>(mv);
  uint16_t* __restrict const v16 = static_cast<uint16_t*>(vv);
  const float w = c.lerp_weight, w_m1 = c.lerp_weight_m1;
  const uint32_t low_mask = c.lerp_low ? 0xffffffffu : 0u;
  const float beta2 = c.beta2, omb2 = c.one_minus_beta2, eps = c.eps;
  // bf16 states multiply by 1 / sqrt(bc2): a divide less an element (reference.py's _adam_update says why).
  const float inv_bc2 = 1.0f / bc2_sqrt;
  const float wd = c.weight_decay, decay = c.decay, gdiv = c.grad.div, gsign = c.grad.sign;
  // bf16: an inner loop per block of 256 elements (one block key). The hash's counter kb + j * kSrGolden is an
  // OpenMP linear variable (the body steps it, as the clause requires), so that a vector of them is one add a step:
  // GCC multiplied a vector of 64-bit indices otherwise.
  for (int64_t i0 = 0; i0 < n;) {
    int64_t i1 = n;
    uint32_t x = 0;
    if constexpr (kBf16) {
      const int64_t j = (k0 + i0) % kSrBlock;
      i1 = min64(n, i0 + kSrBlock - j);
      x = sr_block_key(sr_key, (k0 + i0) / kSrBlock) + static_cast<uint32_t>(j) * kSrGolden;
      prefetch_ahead<kKind>(pv, gv, m16, v16, i0 + kPrefetchAhead, min64(n, i1 + kPrefetchAhead));
#if FASTOPS_HAVE_AVX2 && !FASTOPS_HAVE_AVX512
      if constexpr (kKind == kF32 && kLerp != kLerpMask) {  // the rest of the block (under 8) goes on below
        const int64_t done = (i1 - i0) & ~int64_t{7};
        x = adam_bf16_avx2<kL2, kScale, kLerp>(static_cast<float*>(pv) + i0, static_cast<const float*>(gv) + i0,
                                               m16 + i0, v16 + i0, done, c, neg_step_size, inv_bc2, x);
        i0 += done;
      }
#endif
    }
#pragma omp simd linear(x : kSrGolden)
    for (int64_t i = i0; i < i1; ++i) {
      const float g0 = load_grad<kKind>(gv, i);
      // -(g / s) == g / (-s) exactly, so maximize is folded into the divisor (or the sign when unscaled).
      float gi;
      if constexpr (kScale) gi = g0 / gdiv; else gi = g0 * gsign;
      float pi = load_param<kKind>(pv, i);
      if constexpr (kL2) gi = fmadd(pi, wd, gi);
      pi = pi * decay;
      float mi = kBf16 ? bf16_load(m16[i]) : m[i];
      const float d = gi - mi;
      if constexpr (kLerp == kLerpLow) {
        mi = fmadd(w, d, mi);
      } else if constexpr (kLerp == kLerpHigh) {
        mi = fmadd(w_m1, d, gi);
      } else {
        // Both formulas, picked with a uniform bit mask: GCC 12 does not vectorise a select on a loop-invariant
        // bool between two FMAs (the whole bf16 loop stayed scalar, 5x slower).
        const uint32_t lo_bits = as_bits(fmadd(w, d, mi)), hi_bits = as_bits(fmadd(w_m1, d, gi));
        mi = as_float((lo_bits & low_mask) | (hi_bits & ~low_mask));
      }
      const float vi = fmadd(omb2 * gi, gi, (kBf16 ? bf16_load(v16[i]) : v[i]) * beta2);
      float vu = vi;
      if constexpr (kAms) {
        float vm = vmax[i];
        vm = (vm > vi || vm != vm) ? vm : vi;  // torch.maximum: nan wins
        vmax[i] = vm;
        vu = vm;
      }
      const float root = __builtin_sqrtf(vu);
      const float denom = (kBf16 ? root * inv_bc2 : root / bc2_sqrt) + eps;
      pi = pi + (neg_step_size * mi) / denom;
      store_param<kKind>(pv, outv, i, pi);
      if constexpr (kBf16) {
        const uint32_t r = mix32(x);
        m16[i] = bf16_sr(mi, r & 0xffffu);
        v16[i] = bf16_sr(vi, r >> 16);
        x += kSrGolden;
      } else {
        m[i] = mi;
        v[i] = vi;
      }
    }
    i0 = i1;
  }
}

template <bool kAms, bool kL2, bool kScale>
void adam_range(const AdamTensor& t, const AdamConsts& c, int64_t lo, int64_t hi) {
  for_each_block(t.param, t.grad, t.master, t.dtype, lo, hi,
                 [&](auto kind, void* p, const void* g, void* out, int64_t off, int64_t n) {
                   adam_math<decltype(kind)::value, kAms, kL2, kScale>(
                       p, g, t.exp_avg + off, t.exp_avg_sq + off, kAms ? t.max_exp_avg_sq + off : nullptr, out, n,
                       c, t.neg_step_size, t.bc2_sqrt);
                 });
}

void adam(const AdamTensor& t, const AdamConsts& c, int64_t lo, int64_t hi) {
  switch ((c.amsgrad ? 4 : 0) | (c.l2 ? 2 : 0) | (c.grad.has_scale ? 1 : 0)) {
    case 0: adam_range<false, false, false>(t, c, lo, hi); break;
    case 1: adam_range<false, false, true>(t, c, lo, hi); break;
    case 2: adam_range<false, true, false>(t, c, lo, hi); break;
    case 3: adam_range<false, true, true>(t, c, lo, hi); break;
    case 4: adam_range<true, false, false>(t, c, lo, hi); break;
    case 5: adam_range<true, false, true>(t, c, lo, hi); break;
    case 6: adam_range<true, true, false>(t, c, lo, hi); break;
    default: adam_range<true, true, true>(t, c, lo, hi); break;
  }
}

// ---- Adam with low-precision states (adam_step_lowp_) -------------------------------------------------------
// 8-bit, per block of 256 elements (the 8-bit block, L1-resident): decode both states into fp32 buffers, run
// adam_math on them (the same fp32 operations as adam_step_, so the same as the reference), then re-encode the
// buffers: absmax pass and encode pass, as fastops/_quant.py defines them. bf16: adam_math on the bf16 states
// themselves, a block of 256 (one SrStream) a call. Every output depends only on its block and (seed, tensor,
// element index), so the result is the same for every thread count.

constexpr int64_t kQBlock = 256;

template <bool kL2, bool kScale>
void adam_8bit_range(const LowpTensor& t, const LowpConsts& c, int64_t lo, int64_t hi) {
  alignas(64) float m[kQBlock];
  alignas(64) float v[kQBlock];
  uint8_t* const cm = static_cast<uint8_t*>(t.exp_avg);
  uint8_t* const cv = static_cast<uint8_t*>(t.exp_avg_sq);
  const CodecTables& ts = codec_tables(true);
  const CodecTables& tu = codec_tables(false);
  for (int64_t b0 = lo; b0 < hi; b0 += kQBlock) {
    const int64_t n = min64(kQBlock, hi - b0);
    const int64_t blk = b0 / kQBlock;
    decode_block(cm + b0, t.exp_avg_absmax[blk], ts, m, n);
    decode_block(cv + b0, t.exp_avg_sq_absmax[blk], tu, v, n);
    for_each_block(t.param, t.grad, t.master, t.dtype, b0, b0 + n,
                   [&](auto kind, void* p, const void* g, void* out, int64_t off, int64_t cnt) {
                     adam_math<decltype(kind)::value, false, kL2, kScale>(p, g, m + (off - b0), v + (off - b0),
                                                                          nullptr, out, cnt, c.adam,
                                                                          t.neg_step_size, t.bc2_sqrt);
                   });
    const float am = absmax_of(m, n), av = absmax_of(v, n);
    t.exp_avg_absmax[blk] = am;
    t.exp_avg_sq_absmax[blk] = av;
    encode_block<true>(m, am, cm + b0, n, ts);
    encode_block<false>(v, av, cv + b0, n, tu);
  }
}

// The lerp formula is a template argument here: two FMAs and three logic ops less an element, which the loop on
// AVX2 (16 registers, ports rather than the divider the limit) feels.
template <bool kL2, bool kScale, int kLerp>
void adam_bf16_lerp(const LowpTensor& t, const LowpConsts& c, int64_t lo, int64_t hi) {
  uint16_t* const hm = static_cast<uint16_t*>(t.exp_avg);
  uint16_t* const hv = static_cast<uint16_t*>(t.exp_avg_sq);
  for_each_block(t.param, t.grad, t.master, t.dtype, lo, hi,
                 [&](auto kind, void* p, const void* g, void* out, int64_t off, int64_t n) {
                   adam_math<decltype(kind)::value, false, kL2, kScale, true, kLerp>(
                       p, g, hm + off, hv + off, nullptr, out, n, c.adam, t.neg_step_size, t.bc2_sqrt, t.sr_key, off);
                 });
}

template <bool kL2, bool kScale>
void adam_bf16_range(const LowpTensor& t, const LowpConsts& c, int64_t lo, int64_t hi) {
  if (c.adam.lerp_low) adam_bf16_lerp<kL2, kScale, kLerpLow>(t, c, lo, hi);
  else adam_bf16_lerp<kL2, kScale, kLerpHigh>(t, c, lo, hi);
}

template <bool kL2, bool kScale>
void adam_lowp_range(const LowpTensor& t, const LowpConsts& c, int64_t lo, int64_t hi) {
  if (c.format == StateFormat::kEightBit) adam_8bit_range<kL2, kScale>(t, c, lo, hi);
  else adam_bf16_range<kL2, kScale>(t, c, lo, hi);
}

void adam_lowp(const LowpTensor& t, const LowpConsts& c, int64_t lo, int64_t hi) {
  switch ((c.adam.l2 ? 2 : 0) | (c.adam.grad.has_scale ? 1 : 0)) {
    case 0: adam_lowp_range<false, false>(t, c, lo, hi); break;
    case 1: adam_lowp_range<false, true>(t, c, lo, hi); break;
    case 2: adam_lowp_range<true, false>(t, c, lo, hi); break;
    default: adam_lowp_range<true, true>(t, c, lo, hi); break;
  }
}
