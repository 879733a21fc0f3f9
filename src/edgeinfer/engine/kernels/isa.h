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

// fp32 lanes rounded to bf16 values (to nearest even, as c10::BFloat16; a NaN stays NaN), kept in fp32.
EDGEINFER_TARGET_AVX512_BASE inline __m512 round_bf16x16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))),
                                     _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  return _mm512_mask_mov_ps(_mm512_castsi512_ps(r), _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), v);
}

// fp32 lanes -> their bf16 bits as c10::BFloat16 rounds them (NaN -> 0x7FC0).
EDGEINFER_TARGET_AVX512_BASE inline __m256i bf16_bits(__m512 v) {
  const __m512i r = _mm512_srli_epi32(_mm512_castps_si512(round_bf16x16(v)), 16);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0)));
}

// The steps of sum_lanes16: two vectors' lanes j + (j + 8), a's in the low 256 bits, b's in the high; then
// per 128-bit quarter one vector's four partial sums (j + 4 folded in); then j + 2 folded in.
EDGEINFER_TARGET_AVX512_BASE inline __m512 add_halves(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}

EDGEINFER_TARGET_AVX512_BASE inline __m512 add_quarters(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
}

EDGEINFER_TARGET_AVX512_BASE inline __m512 add_pairs(__m512 x, __m512 y) {
  const __m512d lo = _mm512_castps_pd(x), hi = _mm512_castps_pd(y);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)), _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
}

// The lane sums of 16 accumulators, each halved 8, 4, 2, 1 apart (one order for every accumulator):
// lane i of the result = the sum of a[i]'s lanes. The tree leaves its 4i + q-th input's sum in lane
// 4q + i, so it takes them in transposed order. (Written out: GCC keeps an array of vectors indexed in a
// loop in memory, stored on every step of the caller's loop.)
EDGEINFER_TARGET_AVX512_BASE inline __m512 sum_lanes16(const __m512 (&a)[16]) {
  const __m512 c0 = add_quarters(add_halves(a[0], a[4]), add_halves(a[8], a[12]));
  const __m512 c1 = add_quarters(add_halves(a[1], a[5]), add_halves(a[9], a[13]));
  const __m512 c2 = add_quarters(add_halves(a[2], a[6]), add_halves(a[10], a[14]));
  const __m512 c3 = add_quarters(add_halves(a[3], a[7]), add_halves(a[11], a[15]));
  const __m512 d0 = add_pairs(c0, c1), d1 = add_pairs(c2, c3);
  return _mm512_add_ps(_mm512_shuffle_ps(d0, d1, 0x88), _mm512_shuffle_ps(d0, d1, 0xDD));
}

}  // namespace edgeinfer_cpu
#endif
