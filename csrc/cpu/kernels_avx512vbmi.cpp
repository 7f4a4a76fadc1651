// Kernels for x86-64-v4 plus AVX-512 VBMI (Ice Lake, Zen 4 and later), picked at load time when the CPU has
// them: the same bodies as kernels_avx512.cpp but the 8-bit decode looks its 256-entry table up with vpermi2b
// (codec_isa.h) instead of vgatherdps.
#include <cstdint>

#include "kernels.h"

#ifdef FASTOPS_MULTI_ISA
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4", "avx512vbmi")
#define FASTOPS_ISA_NS isa_avx512_vbmi
#define FASTOPS_ISA_TABLE kTableAvx512Vbmi
#define FASTOPS_ISA_NAME "avx512_vbmi"
#define FASTOPS_HAVE_FMA 1
#define FASTOPS_HAVE_AVX2 1
#define FASTOPS_HAVE_F16C 1
#define FASTOPS_HAVE_AVX512 1
#define FASTOPS_HAVE_AVX512VBMI 1
#include "kernels_isa.h"
#pragma GCC pop_options
#endif
