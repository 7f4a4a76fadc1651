// What every kernel of kernels_isa.h reads and writes, compiled once per ISA: bit casts, fmadd, the bf16 and
// fp16 conversions, and the param/grad access of the optimizer loops (Kind, for_each_block). Included by
// kernels_isa.h inside its FASTOPS_ISA_NS anonymous namespace; includes nothing itself. ce_isa.h uses fmadd,
// as_float and as_bits from here.

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
