// Kernels for the build's baseline target (x86-64 SSE2 unless FASTOPS_NATIVE=1 adds -march=native).
#include <cstdint>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "kernels.h"

#define FASTOPS_ISA_NS isa_default
#define FASTOPS_ISA_TABLE kTableDefault
// Named after what the baseline flags give, so cpu_capability() tells a -march=native build apart.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512VBMI__)
#define FASTOPS_ISA_NAME "avx512_vbmi"
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define FASTOPS_ISA_NAME "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#define FASTOPS_ISA_NAME "avx2"
#else
#define FASTOPS_ISA_NAME "default"
#endif
// Whatever the compiler flags enable (all of it under FASTOPS_NATIVE=1 on this machine).
#if defined(__FMA__)
#define FASTOPS_HAVE_FMA 1
#else
#define FASTOPS_HAVE_FMA 0
#endif
#if defined(__AVX2__)
#define FASTOPS_HAVE_AVX2 1
#else
#define FASTOPS_HAVE_AVX2 0
#endif
#if defined(__F16C__)
#define FASTOPS_HAVE_F16C 1
#else
#define FASTOPS_HAVE_F16C 0
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define FASTOPS_HAVE_AVX512 1
#else
#define FASTOPS_HAVE_AVX512 0
#endif
#if FASTOPS_HAVE_AVX512 && defined(__AVX512VBMI__)
#define FASTOPS_HAVE_AVX512VBMI 1
#else
#define FASTOPS_HAVE_AVX512VBMI 0
#endif
#include "kernels_isa.h"
#include "ce_isa.h"
