// See gemm_bf16.h. A GotoBLAS-shaped GEMM around one micro-kernel: b packed once into panels of 64 columns with its
// rows interleaved in pairs (the layout vdpbf16ps reads), a read in place where it is row-major with even k, else
// packed per tile of 6 rows and 2048 of k; the tiles split over threads; a 6 x 64 fp32 tile of c stays in 24 zmm
// registers while a panel's k pairs stream through. Measured on a 2-vCPU AMD EPYC Zen 5 against the ways torch
// offers (ATen exports no bf16 x bf16 -> fp32 matmul), benchmarks/bench_accumulate.py (results/accumulate_zen5.json),
// GFLOP/s at 1 / 2 threads: c 1024 x 256 += (1024 x 4096) @ (4096 x 256), the fused loss's grad_x over a vocabulary
// block: 378 / 788, as fast as ATen's bf16 matmul (381 / 782, whose output rounds to bf16), where oneDNN's fp32 one on
// the operands widened took 168 / 342 and MKL's mixed GEMM (slow off Intel CPUs) 90 / 166; 32000 x 256 +=
// (512 x 32000)^T @ (512 x 256), a chunk of rows' grad_weight: 309 / 626 (ATen bf16 365 / 735, oneDNN 107 / 195).
#include "cpu/gemm_bf16.h"

#include <immintrin.h>

#include <algorithm>
#include <vector>

#include <ATen/Parallel.h>

namespace fastops {
namespace cpu {
namespace {

constexpr int64_t kRows = 6, kCols = 64, kDepth = 2048;  // the tile of c, and of k per packed tile of a

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

// A tile of 6 rows of a transposed a (rows contiguous in memory, a_col apart along k), 8 readable from `src`: each
// pair of k's rows interleaved by two unpacks.
FASTOPS_BF16_TARGET void pack_columns6(const uint16_t* src, int64_t a_col, int64_t k0, int64_t k, int64_t kp,
                                       uint16_t* ap) {
  for (int64_t p = 0; p < kp; ++p) {
    const int64_t q = k0 + 2 * p;
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + q * a_col));
    const __m128i y = q + 1 < k ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + (q + 1) * a_col))
                                : _mm_setzero_si128();
    _mm_storeu_si128(reinterpret_cast<__m128i*>(ap + 12 * p), _mm_unpacklo_epi16(x, y));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(ap + 12 * p + 8), _mm_unpackhi_epi16(x, y));
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
  std::vector<uint16_t> bp(static_cast<size_t>(panels * panel_size));  // odd k and short panels padded with 0
  at::parallel_for(0, panels * pairs, 256, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t panel = i / pairs, p = i % pairs, j0 = panel * kCols;
      const uint16_t* r0 = b + 2 * p * ldb + j0;
      pack_pair(r0, 2 * p + 1 < k ? r0 + ldb : nullptr, std::min(kCols, n - j0),
                bp.data() + panel * panel_size + p * kCols * 2);
    }
  });
  // A row-major a with even k is read in place; otherwise each tile's rows are packed in pairs per 2048 of k.
  const bool in_place = a_col == 1 && k % 2 == 0;
  at::parallel_for(0, (m + kRows - 1) / kRows, 1, [&](int64_t lo, int64_t hi) {
    std::vector<uint16_t> ap(in_place ? 0 : static_cast<size_t>(kRows * kDepth));
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t i0 = t * kRows, rows = std::min(kRows, m - i0);
      for (int64_t k0 = 0; k0 < k; k0 += kDepth) {
        const int64_t kp = (std::min(kDepth, k - k0) + 1) / 2;
        const uint16_t* tile_a = a + i0 * a_row + k0;
        int64_t rs = a_row, ps = 2;
        if (!in_place) {
          if (a_row == 1 && rows == kRows && i0 + 8 <= m) {
            pack_columns6(a + i0, a_col, k0, k, kp, ap.data());
          } else {
            for (int64_t p = 0; p < kp; ++p) {
              const int64_t q = k0 + 2 * p;
              for (int64_t r = 0; r < rows; ++r) {
                const uint16_t* src = a + (i0 + r) * a_row + q * a_col;
                ap[(p * rows + r) * 2] = src[0];
                ap[(p * rows + r) * 2 + 1] = q + 1 < k ? src[a_col] : 0;
              }
            }
          }
          tile_a = ap.data();
          rs = 2;
          ps = 2 * rows;
        }
        for (int64_t panel = 0; panel < panels; ++panel) {
          kTile[rows](tile_a, rs, ps, bp.data() + panel * panel_size + k0 * kCols, c + i0 * n + panel * kCols, n,
                      kp, static_cast<int>(std::min(kCols, n - panel * kCols)), !(first && k0 == 0));
        }
      }
    }
  });
}

}  // namespace cpu
}  // namespace fastops
