// Kernel bodies, compiled once per ISA: each kernels_<isa>.cpp includes the standard headers, then sets
// `#pragma GCC target(...)`, defines FASTOPS_ISA_NS / FASTOPS_ISA_TABLE / FASTOPS_ISA_NAME and includes this
// file, so every function here gets that ISA and lives in its own namespace (no symbol is shared between
// the copies). This file includes nothing itself but codec_isa.h (the 8-bit codec), inside its namespace.
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

// Elements per on-stack fp32 staging buffer for bf16/fp16 tensors (2 KiB each, L1-resident).
constexpr int64_t kBlock = 512;

inline float as_float(uint32_t u) { return __builtin_bit_cast(float, u); }
inline uint32_t as_bits(float f) { return __builtin_bit_cast(uint32_t, f); }
inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// a*b + c, fused where the ISA has FMA, as at::vec::fmadd is for torch's kernels of the same capability
// (the build uses -ffp-contract=off, so these are the only fused operations).
inline float fmadd(float a, float b, float c) {
#if FASTOPS_HAVE_FMA
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

// ---- bf16 <-> fp32 (bit manipulation; vectorises on every ISA) --------------------------------------

inline float bf16_load(uint16_t h) { return as_float(uint32_t(h) << 16); }

// Round to nearest even, nan -> 0x7fc0: exactly c10::BFloat16(float).
inline uint16_t bf16_round(float f) {
  const uint32_t u = as_bits(f);
  const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? uint16_t(0x7fc0) : uint16_t(r);
}

void load_bf16(const uint16_t* __restrict src, float* __restrict dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_load(src[i]);
}

void store_bf16(const float* __restrict src, uint16_t* __restrict dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_round(src[i]);
}

// ---- fp16 <-> fp32 ------------------------------------------------------------------------------------
// Portable versions: c10's fp16_ieee_to_fp32_value / fp16_ieee_from_fp32_value (same results as F16C's
// round-to-nearest-even conversion for every non-nan input).
// float_to_half_sw rounds through the FPU's own rounding of `x + base`; it is only right without FMA
// contraction (-ffp-contract=off in setup.py).

inline float half_to_float_sw(uint16_t h) {
  const uint32_t w = uint32_t(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = as_float((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = as_float((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t bits = two_w < (1u << 27) ? as_bits(denormalized) : as_bits(normalized);
  return as_float(sign | bits);
}

inline uint16_t float_to_half_sw(float f) {
  float base = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = as_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = as_float((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = as_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return uint16_t((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

void load_half(const uint16_t* __restrict src, float* __restrict dst, int64_t n) {
  int64_t i = 0;
#if FASTOPS_HAVE_AVX512
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#elif FASTOPS_HAVE_F16C
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
#pragma omp simd
  for (int64_t j = i; j < n; ++j) dst[j] = half_to_float_sw(src[j]);
}

void store_half(const float* __restrict src, uint16_t* __restrict dst, int64_t n) {
  int64_t i = 0;
#if FASTOPS_HAVE_AVX512
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif FASTOPS_HAVE_F16C
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
#pragma omp simd
  for (int64_t j = i; j < n; ++j) dst[j] = float_to_half_sw(src[j]);
}

inline void load_lp(Dtype dt, const uint16_t* src, float* dst, int64_t n) {
  if (dt == Dtype::kBFloat16) load_bf16(src, dst, n); else load_half(src, dst, n);
}
inline void store_lp(Dtype dt, const float* src, uint16_t* dst, int64_t n) {
  if (dt == Dtype::kBFloat16) store_bf16(src, dst, n); else store_half(src, dst, n);
}

// ---- param/grad access shared by Adam and SGD ------------------------------------------------------------

// What an update loop reads and writes besides its fp32 states (bf16 conversions are done in the loop;
// fp16 params go through kF32 on staged fp32 blocks, since F16C conversions do not auto-vectorise).
enum Kind : int {
  kF32 = 0,         // p fp32, updated in place; g fp32
  kF32Master = 1,   // p = fp32 master; g fp32; out (fp32 param) = p
  kBF16 = 2,        // p bf16, updated in place; g bf16
  kBF16Master = 3,  // p = fp32 master; g bf16; out (bf16 param) = round(p)
};

template <int kKind>
struct KindTag {
  static constexpr int value = kKind;
};

// Element i of the grad / the value being updated, and the stores of the result, for loop kind kKind.
template <int kKind>
inline float load_grad(const void* __restrict g, int64_t i) {
  if constexpr (kKind == kBF16 || kKind == kBF16Master) return bf16_load(static_cast<const uint16_t*>(g)[i]);
  else return static_cast<const float*>(g)[i];
}
template <int kKind>
inline float load_param(const void* __restrict p, int64_t i) {
  if constexpr (kKind == kBF16) return bf16_load(static_cast<const uint16_t*>(p)[i]);
  else return static_cast<const float*>(p)[i];
}
template <int kKind>
inline void store_param(void* __restrict p, void* __restrict out, int64_t i, float x) {
  if constexpr (kKind == kBF16) static_cast<uint16_t*>(p)[i] = bf16_round(x);
  else static_cast<float*>(p)[i] = x;
  if constexpr (kKind == kF32Master) static_cast<float*>(out)[i] = x;
  if constexpr (kKind == kBF16Master) static_cast<uint16_t*>(out)[i] = bf16_round(x);
}

// Calls body(KindTag<kKind>{}, p, g, out, off, n) over elements [lo, hi) of one tensor: p the values updated
// (the master, or the param itself), g the grad, out the param written from p when p is the master, each
// already offset to element off. fp16 params are converted a block at a time into fp32 in L1, updated as
// kF32 and rounded once on the way back.
template <class Body>
void for_each_block(void* param, const void* grad, float* master, Dtype dt, int64_t lo, int64_t hi, const Body& body) {
  const int64_t n = hi - lo;
  if (n <= 0) return;
  if (dt != Dtype::kHalf) {
    const int64_t es = dt == Dtype::kFloat ? 4 : 2;  // param/grad element size
    char* p = static_cast<char*>(param) + lo * es;
    const char* g = static_cast<const char*>(grad) + lo * es;
    // With master weights the param is write-only. Non-temporal stores for it (staged through L1) were
    // measured here at 32M params (Adam): bf16 +3% with 2 threads and -2% with 1 (noise level), fp32 -16% to
    // -24%, so the param is written with ordinary stores in the same loop.
    if (dt == Dtype::kFloat) {
      if (master) body(KindTag<kF32Master>{}, master + lo, g, p, lo, n);
      else body(KindTag<kF32>{}, p, g, nullptr, lo, n);
    } else {
      if (master) body(KindTag<kBF16Master>{}, master + lo, g, p, lo, n);
      else body(KindTag<kBF16>{}, p, g, nullptr, lo, n);
    }
    return;
  }
  const uint16_t* g16 = static_cast<const uint16_t*>(grad);
  uint16_t* p16 = static_cast<uint16_t*>(param);
  alignas(64) float gbuf[kBlock];
  alignas(64) float pbuf[kBlock];
  for (int64_t off = lo; off < hi; off += kBlock) {
    const int64_t cnt = min64(kBlock, hi - off);
    load_half(g16 + off, gbuf, cnt);
    float* p = pbuf;
    if (master) {
      p = master + off;
    } else {
      load_half(p16 + off, pbuf, cnt);
    }
    body(KindTag<kF32>{}, p, gbuf, nullptr, off, cnt);
    store_half(p, p16 + off, cnt);
  }
}

// ---- Adam ---------------------------------------------------------------------------------------------
// Per element, the operations, their order and their FMAs are those of fastops.reference.adam_step_
// (torch's for-loop Adam) as torch's vectorised CPU kernels compute them: add(alpha) = fma(p, wd, g),
// lerp_ = fma(coeff, g - m, base), mul_ then addcmul_ = fma((1-beta2)*g, g, v*beta2), sqrt / bc2_sqrt + eps,
// addcdiv_ = p + (-step_size*m) / denom. Measured on AVX-512/AVX2 (1M params, 5 steps): m and v match the
// reference bit for bit, p in all but ~0.03% of elements per step, which are 1 ulp off because torch's
// sqrt_ goes through MKL's vsSqrt (not correctly rounded) while sqrtps is. Without FMA (default ISA) the
// results differ from the reference by rounding, as torch's own default-capability kernels would.

template <int kKind, bool kAms, bool kL2, bool kScale>
void adam_math(void* __restrict pv, const void* __restrict gv, float* __restrict m, float* __restrict v,
               float* __restrict vmax, void* __restrict outv, int64_t n, const AdamConsts& c, float neg_step_size,
               float bc2_sqrt) {
  const float w = c.lerp_weight, w_m1 = c.lerp_weight_m1;
  const uint32_t low_mask = c.lerp_low ? 0xffffffffu : 0u;
  const float beta2 = c.beta2, omb2 = c.one_minus_beta2, eps = c.eps;
  const float wd = c.weight_decay, decay = c.decay, gdiv = c.grad.div, gsign = c.grad.sign;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float g0 = load_grad<kKind>(gv, i);
    // -(g / s) == g / (-s) exactly, so maximize is folded into the divisor (or the sign when unscaled).
    float gi;
    if constexpr (kScale) gi = g0 / gdiv; else gi = g0 * gsign;
    float pi = load_param<kKind>(pv, i);
    if constexpr (kL2) gi = fmadd(pi, wd, gi);
    pi = pi * decay;
    float mi = m[i];
    const float d = gi - mi;
    // torch's two lerp formulas, picked with a uniform bit mask: GCC 12 does not vectorise a select on a
    // loop-invariant bool between two FMAs (the whole bf16 loop stayed scalar, 5x slower).
    const uint32_t lo_bits = as_bits(fmadd(w, d, mi)), hi_bits = as_bits(fmadd(w_m1, d, gi));
    mi = as_float((lo_bits & low_mask) | (hi_bits & ~low_mask));
    const float vi = fmadd(omb2 * gi, gi, v[i] * beta2);
    float vu = vi;
    if constexpr (kAms) {
      float vm = vmax[i];
      vm = (vm > vi || vm != vm) ? vm : vi;  // torch.maximum: nan wins
      vmax[i] = vm;
      vu = vm;
    }
    const float denom = __builtin_sqrtf(vu) / bc2_sqrt + eps;
    pi = pi + (neg_step_size * mi) / denom;
    store_param<kKind>(pv, outv, i, pi);
    m[i] = mi;
    v[i] = vi;
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
// Per block of 256 elements (the 8-bit block, L1-resident): decode both states into fp32 buffers, run
// adam_math on them (the same fp32 operations as adam_step_, so the same as the reference), then re-encode
// the buffers: absmax pass and encode pass (8-bit) or stochastic rounding (bf16), as fastops/_quant.py
// defines them. Every output depends only on its block and (seed, tensor, element index), so the result is
// the same for every thread count.

constexpr int64_t kQBlock = 256;

#include "codec_isa.h"

// _quant.mix32: lowbias32.
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

// _quant.round_bf16_stochastic of one element: r16 added below the bf16 mantissa of finite values.
inline uint16_t bf16_sr(float f, uint32_t r16) {
  const uint32_t u = as_bits(f), mag = u & 0x7fffffffu;
  const uint32_t r = (u + (mag < 0x7f800000u ? r16 : 0u)) >> 16;
  return mag > 0x7f800000u ? uint16_t(0x7fc0) : uint16_t(r);
}

// The states of elements [k0, k0 + n) of a tensor, k0 a multiple of 256: _quant.sr_bits hashes
// lo32(k) ^ key ^ hi32(k) * 0x85EBCA6B, whose high half is constant over an aligned block.
void store_bf16_sr(const float* __restrict m, const float* __restrict v, uint16_t* __restrict mo,
                   uint16_t* __restrict vo, int64_t n, uint32_t key, int64_t k0) {
  const uint32_t base = key ^ (static_cast<uint32_t>(static_cast<uint64_t>(k0) >> 32) * 0x85EBCA6Bu);
  const uint32_t lo = static_cast<uint32_t>(k0);
  int64_t i = 0;
#if FASTOPS_HAVE_AVX2
  // GCC 12 left this loop scalar (27% of a bf16 step at 16M params, 3.5 ns/param in all).
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), vbase = _mm256_set1_epi32(int(base));
  const __m256i c1 = _mm256_set1_epi32(0x7FEB352D), c2 = _mm256_set1_epi32(int(0x846CA68Bu));
  const __m256i low16 = _mm256_set1_epi32(0xffff), abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i inf = _mm256_set1_epi32(0x7f800000), qnan = _mm256_set1_epi32(0x7fc0);
  auto round8 = [&](const float* src, __m256i r16) {
    const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(src));
    const __m256i mag = _mm256_and_si256(u, abs_mask);
    const __m256i finite = _mm256_cmpgt_epi32(inf, mag);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_and_si256(r16, finite)), 16);
    r = _mm256_blendv_epi8(r, qnan, _mm256_cmpgt_epi32(mag, inf));
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  };
  for (; i + 8 <= n; i += 8) {
    __m256i x = _mm256_xor_si256(_mm256_add_epi32(_mm256_set1_epi32(int(lo + uint32_t(i))), iota), vbase);
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, c1);
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, c2);
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(mo + i), round8(m + i, _mm256_and_si256(x, low16)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(vo + i), round8(v + i, _mm256_srli_epi32(x, 16)));
  }
#endif
  for (; i < n; ++i) {
    const uint32_t r = mix32((lo + static_cast<uint32_t>(i)) ^ base);
    mo[i] = bf16_sr(m[i], r & 0xffffu);
    vo[i] = bf16_sr(v[i], r >> 16);
  }
}

template <bool kL2, bool kScale>
void adam_lowp_range(const LowpTensor& t, const LowpConsts& c, int64_t lo, int64_t hi) {
  alignas(64) float m[kQBlock];
  alignas(64) float v[kQBlock];
  uint8_t* const cm = static_cast<uint8_t*>(t.exp_avg);
  uint8_t* const cv = static_cast<uint8_t*>(t.exp_avg_sq);
  uint16_t* const hm = static_cast<uint16_t*>(t.exp_avg);
  uint16_t* const hv = static_cast<uint16_t*>(t.exp_avg_sq);
  const CodecTables& ts = codec_tables(true);
  const CodecTables& tu = codec_tables(false);
  for (int64_t b0 = lo; b0 < hi; b0 += kQBlock) {
    const int64_t n = min64(kQBlock, hi - b0);
    const int64_t blk = b0 / kQBlock;
    if (c.format == StateFormat::kEightBit) {
      decode_block(cm + b0, t.exp_avg_absmax[blk], ts, m, n);
      decode_block(cv + b0, t.exp_avg_sq_absmax[blk], tu, v, n);
    } else {
      load_bf16(hm + b0, m, n);
      load_bf16(hv + b0, v, n);
    }
    for_each_block(t.param, t.grad, t.master, t.dtype, b0, b0 + n,
                   [&](auto kind, void* p, const void* g, void* out, int64_t off, int64_t cnt) {
                     adam_math<decltype(kind)::value, false, kL2, kScale>(p, g, m + (off - b0), v + (off - b0),
                                                                          nullptr, out, cnt, c.adam,
                                                                          t.neg_step_size, t.bc2_sqrt);
                   });
    if (c.format == StateFormat::kEightBit) {
      const float am = absmax_of(m, n), av = absmax_of(v, n);
      t.exp_avg_absmax[blk] = am;
      t.exp_avg_sq_absmax[blk] = av;
      encode_block<true>(m, am, cm + b0, n, ts);
      encode_block<false>(v, av, cv + b0, n, tu);
    } else {
      store_bf16_sr(m, v, hm + b0, hv + b0, n, t.sr_key, b0);
    }
  }
}

void adam_lowp(const LowpTensor& t, const LowpConsts& c, int64_t lo, int64_t hi) {
  switch ((c.adam.l2 ? 2 : 0) | (c.adam.grad.has_scale ? 1 : 0)) {
    case 0: adam_lowp_range<false, false>(t, c, lo, hi); break;
    case 1: adam_lowp_range<false, true>(t, c, lo, hi); break;
    case 2: adam_lowp_range<true, false>(t, c, lo, hi); break;
    default: adam_lowp_range<true, true>(t, c, lo, hi); break;
  }
}

// ---- SGD ----------------------------------------------------------------------------------------------
// Per element, fastops.reference.sgd_step_ (torch's for-loop SGD) with the FMAs of torch's vectorised CPU
// ops: grad.add(p, alpha=wd) = fma(p, wd, g); buf.mul_(momentum).add_(g, alpha=1-d) = fma(g, 1-d, buf*mom);
// nesterov's grad.add(buf, alpha=momentum) = fma(buf, mom, g); p.add_(grad, alpha=-lr) = fma(grad, -lr, p).

// kMom: SgdConsts::mom as a template parameter.
template <int kKind, bool kScale, bool kWd, int kMom, bool kNest>
void sgd_math(void* __restrict pv, const void* __restrict gv, float* __restrict buf, void* __restrict outv,
              int64_t n, const SgdConsts& c) {
  const float neg_lr = c.neg_lr, wd = c.weight_decay, mom = c.momentum, omd = c.one_minus_dampening;
  const float gdiv = c.grad.div, gsign = c.grad.sign;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float g0 = load_grad<kKind>(gv, i);
    float gi;
    if constexpr (kScale) gi = g0 / gdiv; else gi = g0 * gsign;  // maximize folded in, as in adam_math
    float pi = load_param<kKind>(pv, i);
    if constexpr (kWd) gi = fmadd(pi, wd, gi);
    if constexpr (kMom != 0) {
      float bi;
      if constexpr (kMom == 1) bi = gi; else bi = fmadd(gi, omd, buf[i] * mom);
      buf[i] = bi;
      if constexpr (kNest) gi = fmadd(bi, mom, gi); else gi = bi;
    }
    store_param<kKind>(pv, outv, i, fmadd(gi, neg_lr, pi));
  }
}

// kCode = scale | wd << 1 | mom << 2 | nesterov << 4 (nesterov only with momentum).
constexpr int kSgdCodes = 32;

template <int kCode>
void sgd_code(const SgdTensor& t, const SgdConsts& c, int64_t lo, int64_t hi) {
  constexpr bool kScale = (kCode & 1) != 0, kWd = (kCode & 2) != 0, kNest = (kCode & 16) != 0;
  constexpr int kMom = (kCode >> 2) & 3;
  if constexpr (kMom < 3 && (kMom != 0 || !kNest)) {
    for_each_block(t.param, t.grad, t.master, t.dtype, lo, hi,
                   [&](auto kind, void* p, const void* g, void* out, int64_t off, int64_t n) {
                     sgd_math<decltype(kind)::value, kScale, kWd, kMom, kNest>(p, g, kMom ? t.buf + off : nullptr,
                                                                               out, n, c);
                   });
  }
}

template <int kCode = 0>
void sgd_dispatch(int code, const SgdTensor& t, const SgdConsts& c, int64_t lo, int64_t hi) {
  if constexpr (kCode < kSgdCodes) {
    if (code == kCode) return sgd_code<kCode>(t, c, lo, hi);
    sgd_dispatch<kCode + 1>(code, t, c, lo, hi);
  }
}

void sgd(const SgdTensor& t, const SgdConsts& c, int64_t lo, int64_t hi) {
  const int code = (c.grad.has_scale ? 1 : 0) | (c.wd ? 2 : 0) | (c.mom << 2) | (c.nesterov && c.mom ? 16 : 0);
  sgd_dispatch(code, t, c, lo, hi);
}

// ---- unscale + non-finite check -------------------------------------------------------------------------

// Largest |x| as bits over [0, n), optionally scaling x in place in the same pass.
inline uint32_t check_scale_f32(float* __restrict x, int64_t n, float inv, bool write) {
  uint32_t mx = 0;
  if (write) {
#pragma omp simd reduction(max : mx)
    for (int64_t i = 0; i < n; ++i) {
      const float xi = x[i];
      const uint32_t a = as_bits(xi) & 0x7fffffffu;
      mx = a > mx ? a : mx;
      x[i] = xi * inv;
    }
  } else {
#pragma omp simd reduction(max : mx)
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t a = as_bits(x[i]) & 0x7fffffffu;
      mx = a > mx ? a : mx;
    }
  }
  return mx;
}

bool unscale(void* g, Dtype dt, int64_t n, float inv, bool write) {
  uint32_t mx = 0;
  if (dt == Dtype::kFloat) {
    mx = check_scale_f32(static_cast<float*>(g), n, inv, write);
  } else {
    uint16_t* x = static_cast<uint16_t*>(g);
    alignas(64) float buf[kBlock];
    for (int64_t off = 0; off < n; off += kBlock) {
      const int64_t cnt = min64(kBlock, n - off);
      load_lp(dt, x + off, buf, cnt);
      const uint32_t b = check_scale_f32(buf, cnt, inv, write);
      mx = b > mx ? b : mx;
      if (write) store_lp(dt, buf, x + off, cnt);
    }
  }
  return mx >= 0x7f800000u;
}

// ---- grad_stats ---------------------------------------------------------------------------------------

// Sum of squares of x * inv and max |x| bits of one block. The grads are unscaled before squaring: a
// scaled fp32 grad above 1.8e19 (reached by a GradScaler after enough growth) would square to inf. kLanes fixed lanes (not the vector width) so that the
// summation order does not depend on the ISA apart from FMA contraction; each lane adds at most
// kStatsBlock / kLanes squares in fp32.
constexpr int kLanes = 32;
constexpr int64_t kStatsBlock = 2048;

void block_stats(const float* __restrict x, int64_t n, float inv, float* sum_out, uint32_t* max_out) {
  float acc[kLanes] = {};
  uint32_t mx[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) {
      const float xj = x[i + j], sj = xj * inv;
      acc[j] = fmadd(sj, sj, acc[j]);
      const uint32_t a = as_bits(xj) & 0x7fffffffu;
      mx[j] = a > mx[j] ? a : mx[j];
    }
  }
  for (int j = 0; i + j < n; ++j) {
    const float xj = x[i + j], sj = xj * inv;
    acc[j] = fmadd(sj, sj, acc[j]);
    const uint32_t a = as_bits(xj) & 0x7fffffffu;
    mx[j] = a > mx[j] ? a : mx[j];
  }
  for (int w = kLanes / 2; w > 0; w /= 2) {
    for (int j = 0; j < w; ++j) {
      acc[j] += acc[j + w];
      mx[j] = mx[j + w] > mx[j] ? mx[j + w] : mx[j];
    }
  }
  *sum_out = acc[0];
  *max_out = mx[0];
}

void stats(const void* g, Dtype dt, int64_t n, float inv, StatsPartial* out) {
  double sum = out->sumsq;
  uint32_t mx = out->max_abs_bits;
  alignas(64) float buf[kStatsBlock];
  for (int64_t off = 0; off < n; off += kStatsBlock) {
    const int64_t cnt = min64(kStatsBlock, n - off);
    const float* x;
    if (dt == Dtype::kFloat) {
      x = static_cast<const float*>(g) + off;
    } else {
      load_lp(dt, static_cast<const uint16_t*>(g) + off, buf, cnt);
      x = buf;
    }
    float s;
    uint32_t b;
    block_stats(x, cnt, inv, &s, &b);
    sum += double(s);
    mx = b > mx ? b : mx;
  }
  out->sumsq = sum;
  out->max_abs_bits = mx;
}

}  // namespace
}  // namespace FASTOPS_ISA_NS

extern const KernelTable FASTOPS_ISA_TABLE = {FASTOPS_ISA_NAME, &FASTOPS_ISA_NS::adam, &FASTOPS_ISA_NS::sgd,
                                              &FASTOPS_ISA_NS::unscale, &FASTOPS_ISA_NS::stats,
                                              &FASTOPS_ISA_NS::adam_lowp};

}  // namespace cpu
}  // namespace fastops
