// SGD, the AMP unscale + non-finite check and grad_stats, compiled once per ISA: included by kernels_isa.h inside
// its FASTOPS_ISA_NS anonymous namespace, after access_isa.h; includes nothing itself.

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

// Sum of squares of x * inv and max |x| bits of one block. The grads are unscaled before squaring: a scaled fp32
// grad above 1.8e19 (reached by a GradScaler after enough growth) would square to inf. kLanes fixed lanes (not the
// vector width) so that the summation order does not depend on the ISA apart from FMA contraction; each lane adds
// at most kStatsBlock / kLanes squares in fp32.
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
