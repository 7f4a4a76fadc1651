// The stochastic rounding of bf16 states (fastops/_quant.py's sr_block_keys, sr_bits and round_bf16_stochastic),
// compiled once per ISA: included by kernels_isa.h inside its FASTOPS_ISA_NS anonymous namespace, after
// access_isa.h; includes nothing itself.
//
// Element j of a block of 256 draws mix32(kb + j * 0x9E3779B9), kb the block's key: in adam_math's vectorised loop
// the counter is an OpenMP linear variable (one add a vector) and the hash one mix32 a lane. Measured on Emerald
// Rapids (65536 params in L2, 1 thread, CPU time, median of 5 interleaved rounds): the fused bf16 step takes 0.84
// ns/param at the avx512 level and 1.03 at avx2 (the fp32 step 0.77, bound by its divides and square root), and
// 0.79 / 0.89 with a multiply-add an element in place of the hash, a stream whose blocks are each correlated
// within (see fastops/_quant.py): the hash costs 0.05-0.14 ns/param in cache and is hidden behind memory beyond.

// Elements a stream block covers: _quant.BLOCK.
constexpr int64_t kSrBlock = 256;

// _quant.mix32: lowbias32.
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

constexpr uint32_t kSrGolden = 0x9E3779B9u;

// _quant.sr_block_keys of `block` (the element index / 256) in a tensor whose key is `key`.
inline uint32_t sr_block_key(uint32_t key, int64_t block) {
  const uint64_t b = static_cast<uint64_t>(block);
  return mix32(key ^ static_cast<uint32_t>(b)) ^ static_cast<uint32_t>(b >> 32);
}

// _quant.round_bf16_stochastic of one element, r16 < 2^16 added below the bf16 mantissa. Infinities need no case of
// their own: 0x7f800000 + 0xffff truncates to 0x7f80 again (and the sign's half likewise), so only nan, whose
// payload could carry into the sign, is picked out.
inline uint16_t bf16_sr(float f, uint32_t r16) {
  const uint16_t r = static_cast<uint16_t>((as_bits(f) + r16) >> 16);
  return f != f ? uint16_t(0x7fc0) : r;
}
