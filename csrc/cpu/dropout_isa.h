// dropout's kernel, compiled once per ISA: included by kernels_isa.h inside its FASTOPS_ISA_NS anonymous namespace,
// after access_isa.h and sr_isa.h; includes nothing itself.
//
// Element k of x's memory is kept when the bf16 states' stream gives it bits >= threshold, and becomes x * scale,
// else x * 0 (fastops/_specs/dropout.py's constants). The stream's hash is the whole cost beyond the copy: torch's CPU
// dropout draws each element from mt19937 through bernoulli_, 5-7 ns an element on an AMD Zen 5 (bf16, 1M elements,
// 1 thread), where this loop takes a few tenths of a ns.

// out[i] = x[i] * (bits >= threshold ? scale : 0) in fp32 for i in [0, n) of one stream block, element i drawing
// mix32(x0 + i * kSrGolden).
inline void dropout_f32(const float* __restrict x, float* __restrict out, int64_t n, uint32_t x0, uint32_t threshold,
                        float scale) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = mix32(x0 + static_cast<uint32_t>(i) * kSrGolden);
    out[i] = x[i] * (bits >= threshold ? scale : 0.0f);
  }
}

// Elements [0, n) of x (dt), element i of them being element k0 + i of the tensor (k0 a multiple of 256).
void dropout(const void* x, void* out, Dtype dt, int64_t k0, int64_t n, uint32_t key, uint32_t threshold,
             float scale) {
  alignas(64) float in[kSrBlock], res[kSrBlock];
  for (int64_t b = 0; b < n; b += kSrBlock) {
    const int64_t cnt = min64(kSrBlock, n - b);
    const uint32_t kb = sr_block_key(key, (k0 + b) / kSrBlock);
    if (dt == Dtype::kFloat) {
      dropout_f32(static_cast<const float*>(x) + b, static_cast<float*>(out) + b, cnt, kb, threshold, scale);
    } else {
      load_lp(dt, static_cast<const uint16_t*>(x) + b, in, cnt);
      dropout_f32(in, res, cnt, kb, threshold, scale);
      store_lp(dt, res, static_cast<uint16_t*>(out) + b, cnt);
    }
  }
}
