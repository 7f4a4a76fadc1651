// Kernels for x86-64-v4 (AVX-512 F/BW/DQ/VL/CD), picked at load time when the CPU has them.
#include <cstdint>

#include "kernels.h"

#ifdef FASTOPS_MULTI_ISA
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")
#define FASTOPS_ISA_NS isa_avx512
#define FASTOPS_ISA_TABLE kTableAvx512
#define FASTOPS_ISA_NAME "avx512"
#define FASTOPS_HAVE_FMA 1
#define FASTOPS_HAVE_AVX2 1
#define FASTOPS_HAVE_F16C 1
#define FASTOPS_HAVE_AVX512 1
#include "kernels_isa.h"
#include "ce_isa.h"
#pragma GCC pop_options
#endif
