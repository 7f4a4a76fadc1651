// adam_math's bf16-states loop for fp32 params and grads at the avx2 level, by hand: the same operations in the same
// order (so the same bits, as tests/test_cpu_isa.py checks at every level), but with the nan check of the stochastic
// rounding done once per 8 elements and branched over. At avx2 the auto-vectorised loop is bound by its vector
// instructions, not by memory, and its per-element nan select (compare, mask, narrow, blend for each state) was a
// fifth of it: 1.14 ns/param with it and 0.95 without, 1M params in cache, 1 thread, CPU time, Emerald Rapids at
// the avx2 level. Included by adam_isa.h inside its FASTOPS_ISA_NS namespace; only compiled where
// FASTOPS_HAVE_AVX2 && !FASTOPS_HAVE_AVX512 (as GCC writes it, the AVX-512 loop is 1.26x-1.35x torch's fused=True
// at 16M/24M params, 1 and 2 threads: README's AdamW figures).

// 8 bf16 values as fp32: one broadcast load of [h | h] and one byte shuffle putting word k in the high half of
// lane k, where a widening load and a shift took a shift-port uop more. With the paired narrowing below, 4 uops
// fewer per 8 elements; measured within this VM's noise: 64K params in L2, avx2 level, 1 thread, 0.92 -> 0.85
// ns/param, and 1.04 both at 128K; bench_adamw's 16M/24M ratios spread 1.14-1.29x before and 1.21-1.31x after.
inline __m256 bf16x8_load(const uint16_t* src) {
  const __m256i h = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  const __m256i to_high = _mm256_setr_epi8(-128, -128, 0, 1, -128, -128, 2, 3, -128, -128, 4, 5, -128, -128, 6, 7,
                                           -128, -128, 8, 9, -128, -128, 10, 11, -128, -128, 12, 13, -128, -128, 14, 15);
  return _mm256_castsi256_ps(_mm256_shuffle_epi8(h, to_high));
}

// bf16_sr on 8 lanes of m and of v: (bits + r16) >> 16, nan lanes 0x7fc0. Both narrowed by one pack and one
// qword permute ([m0-3 v0-3 | m4-7 v4-7] -> [m0-7 | v0-7]); an extract and a pack for each took two shuffles more.
inline void bf16x8_sr_store2(uint16_t* m16, uint16_t* v16, __m256 m, __m256 v, __m256i rm, __m256i rv, bool any_nan) {
  __m256i bm = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(m), rm), 16);
  __m256i bv = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(v), rv), 16);
  if (any_nan) {
    const __m256i qnan = _mm256_set1_epi32(0x7fc0);
    bm = _mm256_blendv_epi8(bm, qnan, _mm256_castps_si256(_mm256_cmp_ps(m, m, _CMP_UNORD_Q)));
    bv = _mm256_blendv_epi8(bv, qnan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  }
  const __m256i mv = _mm256_permute4x64_epi64(_mm256_packus_epi32(bm, bv), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(m16), _mm256_castsi256_si128(mv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(v16), _mm256_extracti128_si256(mv, 1));
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
    bf16x8_sr_store2(m16 + i, v16 + i, mi, vi, _mm256_and_si256(h, low16), _mm256_srli_epi32(h, 16), any_nan);
  }
  return x + static_cast<uint32_t>(i) * kSrGolden;
}
