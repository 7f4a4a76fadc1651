// c (fp32, m x n, row-major) = a @ b (+ c unless first), a and b bf16, through AVX-512 BF16's pair dot products:
// each product of two bf16 is exact in fp32 and the sums are fp32, as in MKL's bf16 x bf16 -> fp32 GEMM. The
// fused loss's exact partial sums on CPUs whose MKL runs slow kernels (csrc/cpu/linear_ce.cpp, ce_accumulate()).
#pragma once

#include <cstdint>

namespace fastops {
namespace cpu {

// The CPU has AVX-512 F, BW, VL, DQ and BF16 (AMD Zen 4 and later, Intel Cooper Lake and later).
bool gemm_bf16_usable();

// a[i][p] at a + i * a_row + p * a_col (a row-major matrix, or the transpose of one), b[p][j] at b + p * ldb + j.
void gemm_bf16_f32(const uint16_t* a, int64_t a_row, int64_t a_col, const uint16_t* b, int64_t ldb, float* c,
                   int64_t m, int64_t n, int64_t k, bool first);

}  // namespace cpu
}  // namespace fastops
