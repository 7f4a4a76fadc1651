// Adam's kernels, compiled once per ISA: adam_step_ on fp32 states and adam_step_lowp_ on 8-bit or bf16 states.
// Included by kernels_isa.h inside its FASTOPS_ISA_NS anonymous namespace, after access_isa.h; includes
// codec_isa.h (the 8-bit codec) itself.

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
    if (c.eight_bit) {
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
    if (c.eight_bit) {
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
