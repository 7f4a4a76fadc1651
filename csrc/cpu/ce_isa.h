// linear_cross_entropy's row pass (log-sum-exp, loss, logits' gradient in place), compiled once per ISA:
// kernels_<isa>.cpp includes this right after kernels_isa.h, under that file's target pragma and with its
// FASTOPS_ISA_NS and FASTOPS_HAVE_* macros (kernels_isa.h's fmadd, as_float, as_bits are reused). Plain loops
// with `#pragma omp simd`, as kernels_isa.h, and an exp GCC can vectorise (libm's expf is not).
#include "ce_kernels.h"

#define FASTOPS_CE_CAT2(a, b) a##b
#define FASTOPS_CE_CAT(a, b) FASTOPS_CE_CAT2(a, b)

namespace fastops {
namespace cpu {
namespace FASTOPS_ISA_NS {
namespace {

// exp(x) for the row pass, within 2 ulp of expf over [-87, 88] (Cephes' expf: x = n ln2 + r, |r| <= ln2/2,
// a degree-6 polynomial for exp(r), n added to the exponent). Below -87 it returns exp(-87) (~2^-125.5): the
// row pass only takes exp of z - max(z) <= 0, where that is far below the sum's rounding (>= 1 * 2^-24).
__attribute__((always_inline)) inline float ce_exp(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  const float t = fmadd(x, 1.44269504088896341f, 12582912.0f);  // 1.5 * 2^23: n = round(x / ln2) in t's low bits
  const float n = t - 12582912.0f;
  float r = fmadd(n, -0.693359375f, x);
  r = fmadd(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = fmadd(p, r, 1.3981999507e-3f);
  p = fmadd(p, r, 8.3334519073e-3f);
  p = fmadd(p, r, 4.1665795894e-2f);
  p = fmadd(p, r, 1.6666665459e-1f);
  p = fmadd(p, r, 5.0000001201e-1f);
  const float y = fmadd(p * r, r, r) + 1.0f;
  return as_float(as_bits(y) + ((as_bits(t) - 0x4B400000u) << 23));
}

template <typename T>
__attribute__((always_inline)) inline float ce_load(const T* p, int64_t j) {
  if constexpr (sizeof(T) == 2) {
    return as_float(uint32_t(p[j]) << 16);
  } else {
    return p[j];
  }
}

template <typename T>
__attribute__((always_inline)) inline T ce_store(float f) {
  if constexpr (sizeof(T) == 2) {  // bf16, round to nearest even
    const uint32_t u = as_bits(f);
    return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  } else {
    return f;
  }
}

// The max and the sum of n logits, in one pass.
template <typename T>
__attribute__((always_inline)) inline void ce_max_sum(const T* z, int64_t n, float& max_out, float& sum_out) {
  float mx = -__builtin_inff();
  float sum = 0.0f;
#pragma omp simd reduction(max : mx) reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const float a = ce_load(z, j);
    mx = a > mx ? a : mx;
    sum += a;
  }
  max_out = mx;
  sum_out = sum;
}

// One row: a pass for the max and the sum of the logits, a pass for the exps (kept in `scratch`, fp32, which a row
// of 150k logits fills to 600 KB: L2-resident) and their sum, and with a gradient a pass that scales the kept exps
// into the gradient, one exp per logit in all.
template <typename T>
void ce_row(T* z, int64_t v, int64_t t, float c, float eps, bool with_grad, float* loss, float* scratch) {
  float mx, zsum;
  ce_max_sum(z, v, mx, zsum);
  float s = 0.0f;
  if (with_grad) {
#pragma omp simd reduction(+ : s)
    for (int64_t j = 0; j < v; ++j) {
      const float e = ce_exp(ce_load(z, j) - mx);
      scratch[j] = e;
      s += e;
    }
  } else {
#pragma omp simd reduction(+ : s)
    for (int64_t j = 0; j < v; ++j) {
      s += ce_exp(ce_load(z, j) - mx);
    }
  }
  const float lse = mx + __builtin_logf(s);
  const float zt = ce_load(z, t);
  // In log-probabilities, as torch: exactly 0 at V = 1.
  float l = (1.0f - eps) * (lse - zt);
  if (eps != 0.0f) {
    l += eps * (lse - zsum / float(v));
  }
  *loss = l;
  if (!with_grad) {
    return;
  }
  // c (e / s - eps / V) = e * (c / s) - c eps / V: the softmax from the kept exp, one multiply and one subtract.
  const float k = c / s, off = c * (eps / float(v));
#pragma omp simd
  for (int64_t j = 0; j < v; ++j) {
    z[j] = ce_store<T>(fmadd(scratch[j], k, -off));
  }
  z[t] = ce_store<T>(c * (ce_exp(zt - lse) - eps / float(v) - (1.0f - eps)));
}

void ce_rows(void* logits, Dtype dt, int64_t v, const int64_t* target, const float* row_grad, float scale,
             float eps, bool with_grad, float* loss, int64_t begin, int64_t end) {
  float* scratch = with_grad ? new float[size_t(v)] : nullptr;
  for (int64_t i = begin; i < end; ++i) {
    const float c = row_grad != nullptr ? scale * row_grad[i] : scale;
    if (dt == Dtype::kFloat) {
      ce_row(static_cast<float*>(logits) + i * v, v, target[i], c, eps, with_grad, loss + i, scratch);
    } else {
      ce_row(static_cast<uint16_t*>(logits) + i * v, v, target[i], c, eps, with_grad, loss + i, scratch);
    }
  }
  delete[] scratch;
}

// One row of a vocabulary block folded into the row's running statistics (CeKernels::block_stats): a pass for the
// block's max and sum, a pass for its exps against the new max, the old sum rescaled to it once.
template <typename T>
void ce_block_row_stats(const T* z, int64_t vb, int64_t t, float* mx, float* s, float* zs, float* zt) {
  float bm, bsum;
  ce_max_sum(z, vb, bm, bsum);
  const float m = bm > *mx ? bm : *mx;
  float e = 0.0f;
#pragma omp simd reduction(+ : e)
  for (int64_t j = 0; j < vb; ++j) {
    e += ce_exp(ce_load(z, j) - m);
  }
  *s = *s * ce_exp(*mx - m) + e;  // the first block: *s = 0 (ce_exp clamps the -inf)
  *mx = m;
  *zs += bsum;
  if (t >= 0 && t < vb) *zt = ce_load(z, t);
}

// One row of a vocabulary block overwritten by its gradient, c (exp(z - lse) - eps / V), less c (1 - eps) at the
// target: ce_row's formula with the row's log-sum-exp from the statistics pass.
template <typename T>
void ce_block_row_grad(T* z, int64_t vb, int64_t t, float lse, float c, float eps, float eps_v) {
  const float zt = t >= 0 && t < vb ? ce_load(z, t) : 0.0f;
  const float off = c * eps_v;
#pragma omp simd
  for (int64_t j = 0; j < vb; ++j) {
    z[j] = ce_store<T>(fmadd(ce_exp(ce_load(z, j) - lse), c, -off));
  }
  if (t >= 0 && t < vb) z[t] = ce_store<T>(c * (ce_exp(zt - lse) - eps_v - (1.0f - eps)));
}

void ce_block_stats(const void* z, Dtype dt, int64_t vb, int64_t v0, const int64_t* target, float* mx, float* s,
                    float* zs, float* zt, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    if (dt == Dtype::kFloat) {
      ce_block_row_stats(static_cast<const float*>(z) + i * vb, vb, target[i] - v0, mx + i, s + i, zs + i, zt + i);
    } else {
      ce_block_row_stats(static_cast<const uint16_t*>(z) + i * vb, vb, target[i] - v0, mx + i, s + i, zs + i,
                         zt + i);
    }
  }
}

void ce_block_grad(void* z, Dtype dt, int64_t vb, int64_t v0, int64_t v, const int64_t* target,
                   const float* row_grad, float scale, float eps, const float* lse, int64_t begin, int64_t end) {
  const float eps_v = eps / float(v);
  for (int64_t i = begin; i < end; ++i) {
    const float c = row_grad != nullptr ? scale * row_grad[i] : scale;
    if (dt == Dtype::kFloat) {
      ce_block_row_grad(static_cast<float*>(z) + i * vb, vb, target[i] - v0, lse[i], c, eps, eps_v);
    } else {
      ce_block_row_grad(static_cast<uint16_t*>(z) + i * vb, vb, target[i] - v0, lse[i], c, eps, eps_v);
    }
  }
}

}  // namespace
}  // namespace FASTOPS_ISA_NS

extern const CeKernels FASTOPS_CE_CAT(kCe_, FASTOPS_ISA_NS) = {FASTOPS_ISA_NAME, &FASTOPS_ISA_NS::ce_rows,
                                                               &FASTOPS_ISA_NS::ce_block_stats,
                                                               &FASTOPS_ISA_NS::ce_block_grad};

}  // namespace cpu
}  // namespace fastops

#undef FASTOPS_CE_CAT
#undef FASTOPS_CE_CAT2
