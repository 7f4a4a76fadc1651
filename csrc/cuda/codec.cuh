// The low-precision state formats of fastops/_quant.py on CUDA, bit for bit: 8-bit blockwise codes (decoded through
// the maps of qmaps.cuh, encoded by arithmetic on the map's decades) and bf16 with stochastic rounding.
// FASTOPS_HOST_DEVICE (__host__ __device__): the CPU build compiles this file for the host too (host_device.h),
// and the CPU tests run it.
#pragma once

#include <cstdint>

#include "host_device.h"
#include "qmaps.cuh"

namespace fastops {
namespace cuda {
namespace detail {

// _quant.encode: decade by threshold, fraction by ((a * P) - 0.1) * F - 0.5 rounded half-even, no FMA.
template <bool SIGNED>
FASTOPS_HOST_DEVICE uint8_t encode(float x) {
  const float* T = SIGNED ? kSignedT : kUnsignedT;
  const float* P = SIGNED ? kSignedP : kUnsignedP;
  const float* F = SIGNED ? kSignedF : kUnsignedF;
  const float a = SIGNED ? fabsf(x) : x;
  int i = 0;
#pragma unroll
  for (int k = 1; k < 7; ++k) i += a >= T[k];
  const int n = SIGNED ? (1 << i) : (2 << i);
  const float t = __fsub_rn(__fmul_rn(__fsub_rn(__fmul_rn(a, P[i]), 0.1f), F[i]), 0.5f);
  int j = static_cast<int>(rintf(t));  // round half to even
  j = j < 0 ? 0 : (j > n - 1 ? n - 1 : j);
  int code = n + j;
  int top = 1;
  if (SIGNED) {
    const bool neg = x < 0.0f;
    code = neg ? (code | 0x80) : code;
    top = neg ? 0xFF : 0x80;
  }
  if (a >= T[7]) code = top;
  if (!(a >= T[0])) code = 0;
  return static_cast<uint8_t>(code);
}

// A code's value times its block's absmax.
template <bool SIGNED>
FASTOPS_HOST_DEVICE float decode(uint8_t code, float absmax) {
  return __fmul_rn(SIGNED ? kSignedQmap[code] : kUnsignedQmap[code], absmax);
}

FASTOPS_HOST_DEVICE uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

// _quant.sr_key(seed, index): the tensor's position in the op's lists, not in its dtype group.
FASTOPS_HOST_DEVICE uint32_t sr_key(uint32_t seed, int64_t index) {
  return mix32(seed ^ mix32(static_cast<uint32_t>(index) + 0x9E3779B9u));
}

// _quant.sr_block_keys: the key of block `block` (element index / 256) of a tensor whose key is `key`.
FASTOPS_HOST_DEVICE uint32_t sr_block_key(uint32_t key, int64_t block) {
  const uint64_t b = static_cast<uint64_t>(block);
  return mix32(key ^ static_cast<uint32_t>(b)) ^ static_cast<uint32_t>(b >> 32);
}

// _quant.sr_bits of element j (0..255) of a block whose key is kb: exp_avg rounds with the low 16 bits, exp_avg_sq
// with the high 16.
FASTOPS_HOST_DEVICE uint32_t sr_bits(uint32_t kb, uint32_t j) { return mix32(kb + j * 0x9E3779B9u); }

// _quant.round_bf16_stochastic: r16 < 2^16 added below the bf16 mantissa. An infinity needs no case of its own
// (0x7f800000 + 0xffff truncates to 0x7f80 again); a nan's payload could carry into the sign.
FASTOPS_HOST_DEVICE unsigned short round_bf16_sr(float x, uint32_t r16) {
  if (x != x) return 0x7FC0;
  return static_cast<unsigned short>((__float_as_uint(x) + r16) >> 16);
}

}  // namespace detail
}  // namespace cuda
}  // namespace fastops
