// See gemm_bf16.h. A GotoBLAS-shaped GEMM around one micro-kernel: b packed once into panels of 64 columns with its
// rows interleaved in pairs (the layout vdpbf16ps reads), a read in place where it is row-major with even k, else
// packed per block of 96 rows and 1024 of k; the blocks split over threads; a 6 x 64 fp32 tile of c stays in 24 zmm
// registers while a panel's k pairs stream through. Measured on a 2-vCPU AMD EPYC Zen 5 against the ways torch
// offers (ATen exports no bf16 x bf16 -> fp32 matmul), benchmarks/bench_accumulate.py (results/accumulate_zen5.json),
// GFLOP/s at 1 / 2 threads: c 1024 x 256 += (1024 x 4096) @ (4096 x 256), the fused loss's grad_x over a vocabulary
// block: 395 / 755, as fast as ATen's bf16 matmul (387 / 732, whose output rounds to bf16), where oneDNN's fp32 one on
// the operands widened took 168 / 305 and MKL's mixed GEMM (slow off Intel CPUs) 92 / 163; 32000 x 256 +=
// (512 x 32000)^T @ (512 x 256), a chunk of rows' grad_weight: 323 / 628 (ATen bf16 374 / 722, oneDNN 110 / 195).
#include "cpu/gemm_bf16.h"

#include <immintrin.h>

#include <algorithm>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

namespace fastops {
namespace cpu {
namespace {

// The tile of c; the rows of a packed together (16 tiles) and the k per pass (96 x 1024 bf16 of a: 192 KiB, in L2).
constexpr int64_t kRows = 6, kCols = 64, kBlockRows = 16 * kRows, kDepth = 1024;

#define FASTOPS_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// c[0..rows) x [0..cols) (+)= a @ bp over kp pairs of k: row r's pair p at a + r * rs + p * ps (a packed tile:
// rs 2, ps 2 * rows; a row-major a read in place: rs its row stride, ps 2), bp[p][64][2].
template <int kR>
FASTOPS_BF16_TARGET void tile(const uint16_t* a, int64_t rs, int64_t ps, const uint16_t* bp, float* c, int64_t ldc,
                              int64_t kp, int cols, bool load_c) {
  __mmask16 mask[4];
  for (int j = 0; j < 4; ++j) mask[j] = static_cast<__mmask16>((1u << std::clamp(cols - 16 * j, 0, 16)) - 1u);
  __m512 acc[kR][4];
  for (int r = 0; r < kR; ++r) {
    for (int j = 0; j < 4; ++j) acc[r][j] = load_c ? _mm512_maskz_loadu_ps(mask[j], c + r * ldc + 16 * j) : _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < kp; ++p, bp += 2 * kCols, a += ps) {
    __m512bh b[4];
    for (int j = 0; j < 4; ++j) b[j] = (__m512bh)_mm512_loadu_si512(bp + 32 * j);
    for (int r = 0; r < kR; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(a + r * rs));
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], x, b[j]);
    }
  }
  for (int r = 0; r < kR; ++r) {
    for (int j = 0; j < 4; ++j) _mm512_mask_storeu_ps(c + r * ldc + 16 * j, mask[j], acc[r][j]);
  }
}

using Tile = void (*)(const uint16_t*, int64_t, int64_t, const uint16_t*, float*, int64_t, int64_t, int, bool);
constexpr Tile kTile[kRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

// out[2j] = r0[j], out[2j + 1] = r1[j] (0 without r1) for the panel's 64 columns, 0 past `cols`: two word
// permutes per 32 columns, where the element loop took a fifth of a 1024 x 4096 @ 4096 x 256 product's time.
FASTOPS_BF16_TARGET void pack_pair(const uint16_t* r0, const uint16_t* r1, int64_t cols, uint16_t* out) {
  alignas(64) static constexpr uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                   8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(kLo), hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t half = 0; half < 2; ++half) {
    const int64_t left = std::clamp<int64_t>(cols - 32 * half, 0, 32);
    const __mmask32 m = left == 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << left) - 1u);
    const __m512i x = _mm512_maskz_loadu_epi16(m, r0 + 32 * half);
    const __m512i y = r1 != nullptr ? _mm512_maskz_loadu_epi16(m, r1 + 32 * half) : _mm512_setzero_si512();
    _mm512_storeu_si512(out + 64 * half, _mm512_permutex2var_epi16(x, lo, y));
    _mm512_storeu_si512(out + 64 * half + 32, _mm512_permutex2var_epi16(x, hi, y));
  }
}

// Rows [i0, i0 + rows) of a transposed a (its rows contiguous in memory, a_col apart along k), pairs [0, kp) of
// k from k0, as ap[p][rows][2]: each pair of k's rows interleaved 8 rows at a time by two unpacks, where a pack per
// tile of 6 rows touched the 512 lines of a chunk's k for every 12 bytes it took (grad_weight's chunks ran at
// 0.85x ATen's bf16 rate then).
FASTOPS_BF16_TARGET void pack_transposed(const uint16_t* a, int64_t a_col, int64_t i0, int64_t rows, int64_t k0,
                                         int64_t k, int64_t kp, uint16_t* ap) {
  const int64_t vec = rows / 8 * 8;
  for (int64_t p = 0; p < kp; ++p) {
    const int64_t q = k0 + 2 * p;
    const uint16_t* x = a + q * a_col + i0;
    const uint16_t* y = q + 1 < k ? x + a_col : nullptr;
    uint16_t* out = ap + 2 * rows * p;
    for (int64_t r = 0; r < vec; r += 8) {
      const __m128i xv = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + r));
      const __m128i yv = y != nullptr ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(y + r)) : _mm_setzero_si128();
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * r), _mm_unpacklo_epi16(xv, yv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * r + 8), _mm_unpackhi_epi16(xv, yv));
    }
    for (int64_t r = vec; r < rows; ++r) {
      out[2 * r] = x[r];
      out[2 * r + 1] = y != nullptr ? y[r] : 0;
    }
  }
}

}  // namespace

bool gemm_bf16_usable() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16");
}

void gemm_bf16_f32(const uint16_t* a, int64_t a_row, int64_t a_col, const uint16_t* b, int64_t ldb, float* c,
                   int64_t m, int64_t n, int64_t k, bool first) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {
    if (first) std::fill(c, c + m * n, 0.0f);
    return;
  }
  const int64_t pairs = (k + 1) / 2, panels = (n + kCols - 1) / kCols, panel_size = pairs * kCols * 2;
  // Through torch's allocator: fastops.accelerate's CPU block cache keeps it mapped from call to call.
  const at::Tensor bp_buf = at::empty({panels * panel_size}, at::kShort);
  uint16_t* const bp = reinterpret_cast<uint16_t*>(bp_buf.data_ptr());
  at::parallel_for(0, panels * pairs, 256, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t panel = i / pairs, p = i % pairs, j0 = panel * kCols;
      const uint16_t* r0 = b + 2 * p * ldb + j0;
      pack_pair(r0, 2 * p + 1 < k ? r0 + ldb : nullptr, std::min(kCols, n - j0),
                bp + panel * panel_size + p * kCols * 2);
    }
  });
  // A row-major a with even k is read in place; otherwise the rows of a block of 16 tiles are packed together, pairs
  // of k interleaved, per 1024 of k.
  // Blocks of one tile where nothing is packed, and at least 4 per thread: 11 blocks of 96 rows at m = 1024 left one
  // of 2 threads a sixth more work.
  const bool in_place = a_col == 1 && k % 2 == 0;
  const int64_t tiles = (m + kRows - 1) / kRows;
  const int64_t per_block = in_place ? 1 : std::clamp<int64_t>(tiles / (4 * at::get_num_threads()), 1, kBlockRows / kRows);
  const int64_t span = per_block * kRows;
  at::parallel_for(0, (tiles + per_block - 1) / per_block, 1, [&](int64_t lo, int64_t hi) {
    std::vector<uint16_t> ap(in_place ? 0 : static_cast<size_t>(span * kDepth));
    for (int64_t blk = lo; blk < hi; ++blk) {
      const int64_t b0 = blk * span, block_rows = std::min(span, m - b0);
      for (int64_t k0 = 0; k0 < k; k0 += kDepth) {
        const int64_t kp = (std::min(kDepth, k - k0) + 1) / 2;
        if (!in_place && a_row == 1) {
          pack_transposed(a, a_col, b0, block_rows, k0, k, kp, ap.data());
        } else if (!in_place) {
          for (int64_t p = 0; p < kp; ++p) {
            const int64_t q = k0 + 2 * p;
            for (int64_t r = 0; r < block_rows; ++r) {
              const uint16_t* src = a + (b0 + r) * a_row + q * a_col;
              ap[(p * block_rows + r) * 2] = src[0];
              ap[(p * block_rows + r) * 2 + 1] = q + 1 < k ? src[a_col] : 0;
            }
          }
        }
        for (int64_t i0 = b0; i0 < b0 + block_rows; i0 += kRows) {
          const int64_t rows = std::min(kRows, m - i0);
          const uint16_t* tile_a = in_place ? a + i0 * a_row + k0 : ap.data() + 2 * (i0 - b0);
          const int64_t rs = in_place ? a_row : 2, ps = in_place ? 2 : 2 * block_rows;
          for (int64_t panel = 0; panel < panels; ++panel) {
            kTile[rows](tile_a, rs, ps, bp + panel * panel_size + k0 * kCols, c + i0 * n + panel * kCols, n, kp,
                        static_cast<int>(std::min(kCols, n - panel * kCols)), !(first && k0 == 0));
          }
        }
      }
    }
  });
}

}  // namespace cpu
}  // namespace fastops
