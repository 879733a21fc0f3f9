// Which instruction sets the kernels may use, decided at run time (isa.cpp).
//
// Every kernel variant is compiled with its own target attribute and runs only where the CPU (and the OS,
// for the AVX-512 register state) reports its features, so one build works on any x86-64 CPU and never
// executes an illegal instruction. `EDGEINFER_CPU_ISA` (or `set_isa_cap`, for tests) caps the level below
// what the CPU has, to exercise the fallbacks.

#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define EDGEINFER_X86 1
#else
#define EDGEINFER_X86 0
#endif

namespace edgeinfer_cpu {

// Ordered: a cap at one level allows every level below it that the CPU has.
enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Vnni = 3, kAvx512Bf16 = 4 };

// Whether kernels of `level` may run: the CPU has its features and the cap allows it.
bool isa_allows(Isa level);

// The best level allowed (for reports), e.g. "avx512_bf16".
std::string isa_name();

// Cap the levels the kernels use ("scalar", "avx2", "avx512", "avx512_vnni", "avx512_bf16" = no cap).
void set_isa_cap(const std::string& name);

// A bf16 value's bits -> its float (bf16 is the top half of an fp32): exact.
inline float bf16_bits_to_float(uint16_t v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace edgeinfer_cpu

#define EDGEINFER_TARGET_AVX2 __attribute__((target("avx2,fma")))
#define EDGEINFER_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))
#define EDGEINFER_TARGET_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define EDGEINFER_TARGET_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
// Only the base AVX-512 instructions: a helper with this target inlines into the kernels of every AVX-512 level.
#define EDGEINFER_TARGET_AVX512_BASE __attribute__((target("avx512f,avx512bw,avx512vl")))

#if EDGEINFER_X86
namespace edgeinfer_cpu {

// 16 bf16 values (the lanes of `mask`; the others 0) -> fp32 lanes, exact.
EDGEINFER_TARGET_AVX512_BASE inline __m512 bf16x16_to_fp32(const uint16_t* p, __mmask16 mask = 0xFFFF) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

}  // namespace edgeinfer_cpu
#endif
