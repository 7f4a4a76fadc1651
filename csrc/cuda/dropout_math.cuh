// dropout's per-element math (fastops/_specs/dropout.py), shared by the CUDA kernel (dropout.cu) and its host
// compilation in cuda_math.cpp, which the CPU tests run against the reference.
#pragma once

#include <cstdint>

#include "codec.cuh"
#include "host_device.h"

namespace fastops {
namespace cuda {
namespace detail {

// What element k of x's memory is multiplied by: scale where the bf16 states' stream under `key` gives it bits >=
// threshold, else 0.
FASTOPS_HOST_DEVICE float dropout_factor(uint32_t key, int64_t k, uint32_t threshold, float scale) {
  const uint32_t bits = sr_bits(sr_block_key(key, k >> 8), static_cast<uint32_t>(k & 255));
  return bits >= threshold ? scale : 0.0f;
}

}  // namespace detail
}  // namespace cuda
}  // namespace fastops
