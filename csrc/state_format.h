// How Adam's two moments are stored: fastops/_quant.py's StateFormat, the one name of the concept in C++. An
// adam_step_lowp_ call tells it from the dtype of its exp_avgs (fastops::state_format, csrc/cpu/checks.cpp). No torch
// or CUDA header here: the ISA kernels (csrc/cpu/kernels.h) and the CUDA kernels (csrc/cuda/args.h) take it too.
#pragma once

#include <cstdint>

namespace fastops {

enum class StateFormat : int8_t {
  kFp32 = 0,
  kBf16 = 1,      // bf16, stochastic rounding on every write
  kEightBit = 2,  // uint8 codes of bitsandbytes' dynamic maps + one fp32 absmax per 256 elements
};

}  // namespace fastops
