// Kernels for x86-64-v3 (AVX2, FMA, F16C), picked at load time when the CPU has them.
#include <cstdint>

#include "kernels.h"

#ifdef FASTOPS_MULTI_ISA
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3")
#define FASTOPS_ISA_NS isa_avx2
#define FASTOPS_ISA_TABLE kTableAvx2
#define FASTOPS_ISA_NAME "avx2"
#define FASTOPS_HAVE_FMA 1
#define FASTOPS_HAVE_AVX2 1
#define FASTOPS_HAVE_F16C 1
#define FASTOPS_HAVE_AVX512 0
#include "kernels_isa.h"
#include "ce_isa.h"
#pragma GCC pop_options
#endif
