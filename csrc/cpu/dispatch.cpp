// Picks the kernel table once, at first use: the widest ISA this CPU supports, lowered by
// FASTOPS_CPU_CAPABILITY=default|avx2|avx512|avx512_vbmi (as ATEN_CPU_CAPABILITY does for torch), which is
// how the tests reach the narrower kernels on an AVX-512 machine (avx512 is AVX-512 without VBMI's byte
// permutes, so a VBMI machine runs both 8-bit decoders).
#include <cstdlib>
#include <cstring>

#include <c10/util/Exception.h>

#include "fastops.h"
#include "kernels.h"

namespace fastops {
namespace cpu {
namespace {

const KernelTable* choose() {
  constexpr int kLevels = 4;
  static const char* const names[kLevels] = {"default", "avx2", "avx512", "avx512_vbmi"};
  const KernelTable* tables[kLevels] = {&kTableDefault, nullptr, nullptr, nullptr};
  int best = 0;
#ifdef FASTOPS_MULTI_ISA
  tables[1] = &kTableAvx2;
  tables[2] = &kTableAvx512;
  tables[3] = &kTableAvx512Vbmi;
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4")) {
    best = __builtin_cpu_supports("avx512vbmi") ? 3 : 2;
  } else if (__builtin_cpu_supports("x86-64-v3")) {
    best = 1;
  }
#endif
  const char* env = std::getenv("FASTOPS_CPU_CAPABILITY");
  if (env != nullptr && *env != '\0') {
    int want = -1;
    for (int i = 0; i < kLevels; ++i) {
      if (std::strcmp(env, names[i]) == 0) want = i;
    }
    if (want < 0) {
      TORCH_WARN("fastops: ignoring FASTOPS_CPU_CAPABILITY=", env, " (expected default, avx2, avx512 or avx512_vbmi)");
    } else if (want < best) {
      best = want;
    }
  }
  return tables[best];
}

}  // namespace

const KernelTable& kernels() {
  static const KernelTable* const table = choose();
  return *table;
}

const char* capability() { return kernels().name; }

}  // namespace cpu
}  // namespace fastops
