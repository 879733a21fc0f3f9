// The codes of a paged KV pool as quant/kv.py stores them: bf16 values, or int8 / float8 (e4m3fn, e5m2)
// codes with one fp32 scale per (token, KV head), the stored value being code x scale. The decode attention
// (decode_ops.cpp) reads them where they lie; the fused step and paged_decode_one write them (kv_write.cpp).
//
// Every code's value is exact in bf16 and in fp32 (int8: |code| <= 127; e4m3 / e5m2: 3 / 2 mantissa bits,
// their subnormals normal in bf16), so the attention multiplies codes by the query or the probabilities
// without rounding and applies a key's scale once: to its score and to its probability. The float8 codes
// read as quant/packing.py's fp8_to_bf16 reads them: the e4m3 NaN code (and e5m2's infinities and NaNs)
// as the finite value their bits spell, since a row that held a NaN has a NaN scale.

#pragma once

#include "isa.h"

#include <ATen/ATen.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace edgeinfer_cpu::kv {

enum class Fmt { kBf16, kInt8, kE4m3, kE5m2 };

inline Fmt format_of(const at::Tensor& pool) {
  switch (pool.scalar_type()) {
    case at::kBFloat16: return Fmt::kBf16;
    case at::kChar: return Fmt::kInt8;
    case at::kFloat8_e4m3fn: return Fmt::kE4m3;
    case at::kFloat8_e5m2: return Fmt::kE5m2;
    default: TORCH_CHECK(false, "a KV pool of ", pool.scalar_type(), ": bf16, int8, float8_e4m3fn or float8_e5m2 only");
  }
}

constexpr int64_t code_bytes(Fmt f) { return f == Fmt::kBf16 ? 2 : 1; }

// A float8 format's mantissa bits, exponent bias and largest finite value (torch.finfo(...).max).
template <Fmt F>
struct Fp8;
template <>
struct Fp8<Fmt::kE4m3> {
  static constexpr int kMant = 3, kBias = 7;
  static constexpr float kMax = 448.f;
};
template <>
struct Fp8<Fmt::kE5m2> {
  static constexpr int kMant = 2, kBias = 15;
  static constexpr float kMax = 57344.f;
};

// A float8 code's value: normal codes by moving exponent and mantissa into an fp32's fields (exponent
// rebiased), subnormal ones (exponent 0) as m x 2^(1 - bias - M).
template <Fmt F>
float fp8_value(uint8_t code) {
  constexpr int M = Fp8<F>::kMant, B = Fp8<F>::kBias;
  const uint32_t mag = code & 0x7F;
  float v;
  if (mag >> M == 0) {
    v = std::ldexp(static_cast<float>(mag), 1 - B - M);
  } else {
    const uint32_t u = (mag << (23 - M)) + (static_cast<uint32_t>(127 - B) << 23);
    std::memcpy(&v, &u, sizeof v);
  }
  return code & 0x80 ? -v : v;
}

// The value of each of a one-byte format's 256 codes.
template <Fmt F>
const std::array<float, 256>& code_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) {
      if constexpr (F == Fmt::kInt8)
        t[c] = static_cast<float>(static_cast<int8_t>(c));
      else
        t[c] = fp8_value<F>(static_cast<uint8_t>(c));
    }
    return t;
  }();
  return table;
}

// The bf16 bits of a float8 format's subnormal values m x 2^(1 - bias - M), indexed by m (vpermw's table).
template <Fmt F>
constexpr std::array<uint16_t, 32> fp8_subnormal_bits() {
  constexpr int M = Fp8<F>::kMant, B = Fp8<F>::kBias;
  std::array<uint16_t, 32> t{};
  for (int m = 1; m < (1 << M); ++m) {
    int top = 0;
    while (m >> (top + 1)) ++top;
    t[m] = static_cast<uint16_t>(((top + 1 - B - M + 127) << 7) | ((m - (1 << top)) << (7 - top)));
  }
  return t;
}

template <Fmt F>
inline constexpr std::array<uint16_t, 32> kSubnormalBits = fp8_subnormal_bits<F>();

#if EDGEINFER_X86
// Sign-extended float8 codes (one per 16-bit lane, the sign in bit 15) -> their bf16 bits: exponent and
// mantissa moved into bf16's fields and the exponent rebiased; where the exponent is 0 (subnormal), the
// value from kSubnormalBits (vpermw reads a lane's low 5 bits, which then hold the mantissa alone).
template <Fmt F>
EDGEINFER_TARGET_AVX512_BASE inline __m512i fp8_to_bf16_bits(__m512i w) {
  constexpr int M = Fp8<F>::kMant, B = Fp8<F>::kBias;
  const __m512i moved = _mm512_and_si512(_mm512_slli_epi16(w, 7 - M), _mm512_set1_epi16(0x7F << (7 - M)));
  const __m512i normal = _mm512_add_epi16(moved, _mm512_set1_epi16((127 - B) << 7));
  const __mmask32 sub = _mm512_testn_epi16_mask(w, _mm512_set1_epi16(0x7F & ~((1 << M) - 1)));
  const __m512i table = _mm512_loadu_si512(kSubnormalBits<F>.data());
  const __m512i value = _mm512_mask_permutexvar_epi16(normal, sub, w, table);
  return _mm512_ternarylogic_epi32(value, w, _mm512_set1_epi16(static_cast<int16_t>(0x8000)), 0xF8);  // a | (b & c)
}

template <Fmt F>
EDGEINFER_TARGET_AVX512_BASE inline __m256i fp8_to_bf16_bits(__m256i w) {
  constexpr int M = Fp8<F>::kMant, B = Fp8<F>::kBias;
  const __m256i moved = _mm256_and_si256(_mm256_slli_epi16(w, 7 - M), _mm256_set1_epi16(0x7F << (7 - M)));
  const __m256i normal = _mm256_add_epi16(moved, _mm256_set1_epi16((127 - B) << 7));
  const __mmask16 sub = _mm256_testn_epi16_mask(w, _mm256_set1_epi16(0x7F & ~((1 << M) - 1)));
  const __m256i table = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kSubnormalBits<F>.data()));
  const __m256i value = _mm256_mask_permutexvar_epi16(normal, sub, w, table);
  return _mm256_ternarylogic_epi32(value, w, _mm256_set1_epi16(static_cast<int16_t>(0x8000)), 0xF8);
}

// 16 one-byte codes (the lanes of `mask`; the others 0) -> their values in fp32 lanes, exact.
template <Fmt F>
EDGEINFER_TARGET_AVX512_BASE inline __m512 codes16_to_fp32(const uint8_t* p, __mmask16 mask = 0xFFFF) {
  const __m128i bytes = _mm_maskz_loadu_epi8(mask, p);
  if constexpr (F == Fmt::kInt8) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
  } else {
    const __m256i bits = fp8_to_bf16_bits<F>(_mm256_cvtepi8_epi16(bytes));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
}

// 32 one-byte codes -> their values as 32 bf16 in order, exact.
template <Fmt F>
EDGEINFER_TARGET_BF16 inline __m512i codes32_to_bf16(const uint8_t* p) {
  if constexpr (F == Fmt::kInt8) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    const __m512 hi =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // integers of up to 7 bits: exact in bf16
  } else {
    return fp8_to_bf16_bits<F>(_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  }
}
#endif

}  // namespace edgeinfer_cpu::kv
