// adam_math's bf16-states loop for fp32 params and grads at the avx2 level, by hand: the same operations in the same
// order (so the same bits, as tests/test_cpu_isa.py checks at every level), but with the nan check of the stochastic
// rounding done once per 8 elements and branched over. At avx2 the auto-vectorised loop is bound by its vector
// instructions, not by memory, and its per-element nan select (compare, mask, narrow, blend for each state) was a
// fifth of it: 1.14 ns/param with it and 0.95 without, 1M params in cache, 1 thread, CPU time, Emerald Rapids at
// the avx2 level. Included by adam_isa.h inside its FASTOPS_ISA_NS namespace; only compiled where
// FASTOPS_HAVE_AVX2 && !FASTOPS_HAVE_AVX512 (as GCC writes it, the AVX-512 loop is 1.26x-1.35x torch's fused=True
// at 16M/24M params, 1 and 2 threads: README's AdamW figures).

// 8 bf16 values (the high halves of 8 fp32 bit patterns, each already < 2^16) as one 128-bit store.
inline __m128i narrow_high16(__m256i b) {
  return _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
}

inline __m256 bf16x8_load(const uint16_t* src) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// bf16_sr on 8 lanes: (bits + r16) >> 16, nan lanes 0x7fc0.
inline __m128i bf16x8_sr(__m256 f, __m256i r16, bool any_nan) {
  __m256i b = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(f), r16), 16);
  if (any_nan) b = _mm256_blendv_epi8(b, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
  return narrow_high16(b);
}

// Elements [0, n) of one stream block, element j drawing mix32(x + j * kSrGolden); returns x past the last one.
template <bool kL2, bool kScale, int kLerp>
uint32_t adam_bf16_avx2(float* __restrict p, const float* __restrict g, uint16_t* __restrict m16,
                        uint16_t* __restrict v16, int64_t n, const AdamConsts& c, float neg_step_size, float inv_bc2,
                        uint32_t x) {
  const __m256 gdiv = _mm256_set1_ps(c.grad.div), gsign = _mm256_set1_ps(c.grad.sign);
  const __m256 wd = _mm256_set1_ps(c.weight_decay), decay = _mm256_set1_ps(c.decay);
  const __m256 w = _mm256_set1_ps(kLerp == kLerpLow ? c.lerp_weight : c.lerp_weight_m1);
  const __m256 omb2 = _mm256_set1_ps(c.one_minus_beta2), beta2 = _mm256_set1_ps(c.beta2);
  const __m256 inv = _mm256_set1_ps(inv_bc2), eps = _mm256_set1_ps(c.eps), nss = _mm256_set1_ps(neg_step_size);
  const __m256i low16 = _mm256_set1_epi32(0xffff);
  const __m256i k1 = _mm256_set1_epi32(static_cast<int>(0x7FEB352Du)), k2 = _mm256_set1_epi32(static_cast<int>(0x846CA68Bu));
  __m256i xv = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(x)),
                                _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                                   _mm256_set1_epi32(static_cast<int>(kSrGolden))));
  const __m256i step = _mm256_set1_epi32(static_cast<int>(8u * kSrGolden));
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g0 = _mm256_loadu_ps(g + i);
    __m256 gi = kScale ? _mm256_div_ps(g0, gdiv) : _mm256_mul_ps(g0, gsign);
    __m256 pi = _mm256_loadu_ps(p + i);
    if constexpr (kL2) gi = _mm256_fmadd_ps(pi, wd, gi);
    pi = _mm256_mul_ps(pi, decay);
    __m256 mi = bf16x8_load(m16 + i);
    const __m256 d = _mm256_sub_ps(gi, mi);
    mi = _mm256_fmadd_ps(w, d, kLerp == kLerpLow ? mi : gi);
    const __m256 vi = _mm256_fmadd_ps(_mm256_mul_ps(omb2, gi), gi, _mm256_mul_ps(bf16x8_load(v16 + i), beta2));
    const __m256 denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(vi), inv), eps);
    pi = _mm256_add_ps(pi, _mm256_div_ps(_mm256_mul_ps(nss, mi), denom));
    _mm256_storeu_ps(p + i, pi);
    __m256i h = _mm256_xor_si256(xv, _mm256_srli_epi32(xv, 16));  // mix32, 8 lanes
    h = _mm256_mullo_epi32(h, k1);
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 15));
    h = _mm256_mullo_epi32(h, k2);
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
    xv = _mm256_add_epi32(xv, step);
    const bool any_nan = _mm256_movemask_ps(_mm256_cmp_ps(mi, vi, _CMP_UNORD_Q)) != 0;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(m16 + i), bf16x8_sr(mi, _mm256_and_si256(h, low16), any_nan));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(v16 + i), bf16x8_sr(vi, _mm256_srli_epi32(h, 16), any_nan));
  }
  return x + static_cast<uint32_t>(i) * kSrGolden;
}
