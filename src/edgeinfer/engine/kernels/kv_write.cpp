// A decode step's new K or V rows written into a paged pool (kv_codes.h): bf16 as they are; int8 and float8
// quantized per (token, KV head) as quant/kv.py's Int8KV and Fp8KV quantize them, so the fused step (and
// paged_decode_one) store what the eager path's `storage.write` stores, bit for bit: the fp32 scale
// amax / qmax (1 where the row is all zeros), then int8 round(x / scale) to even, clamped to +-127, or
// float8 x / scale clamped to +-max and rounded to nearest even (c10's conversion, as `.to()` does).

#include "kv_codes.h"
#include "ops.h"

#include <ATen/ATen.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

using edgeinfer_cpu::bf16_bits_to_float;
using edgeinfer_cpu::kv::Fmt;

template <Fmt F>
uint8_t encode(float x) {
  if constexpr (F == Fmt::kInt8) {
    if (std::isnan(x)) return 0;  // the row's scale is NaN: its codes do not matter
    return static_cast<uint8_t>(static_cast<int8_t>(std::clamp(std::nearbyint(x), -127.f, 127.f)));
  } else {
    constexpr float kMax = edgeinfer_cpu::kv::Fp8<F>::kMax;
    const float c = std::clamp(x, -kMax, kMax);  // NaN stays NaN
    if constexpr (F == Fmt::kE4m3)
      return c10::Float8_e4m3fn(c).x;
    else
      return c10::Float8_e5m2(c).x;
  }
}

template <Fmt F>
float largest_code() {
  if constexpr (F == Fmt::kInt8)
    return 127.f;
  else
    return edgeinfer_cpu::kv::Fp8<F>::kMax;
}

// One (token, head) row of `d` bf16 values -> its codes and scale.
template <Fmt F>
void quantize_row(const uint16_t* x, int64_t d, uint8_t* codes, float* scale) {
  float amax = 0.f;
  for (int64_t i = 0; i < d; ++i) {
    const float a = std::fabs(bf16_bits_to_float(x[i]));
    amax = std::isnan(a) || std::isnan(amax) ? std::numeric_limits<float>::quiet_NaN() : std::max(amax, a);
  }
  float s = amax / largest_code<F>();
  if (s == 0.f) s = 1.f;
  for (int64_t i = 0; i < d; ++i) codes[i] = encode<F>(bf16_bits_to_float(x[i]) / s);
  *scale = s;
}

template <Fmt F>
void quantize_rows(const uint16_t* x, int64_t rows, int64_t d, uint8_t* codes, float* scales) {
  for (int64_t r = 0; r < rows; ++r) quantize_row<F>(x + r * d, d, codes + r * d, scales + r);
}

}  // namespace

namespace edgeinfer_cpu {

void write_kv(const at::Tensor& pool, const at::Tensor& scales, const int64_t* slots, int64_t tokens,
              const at::Tensor& x) {
  TORCH_CHECK(pool.dim() == 4 && pool.is_contiguous(), "write_kv: the pool must be contiguous [blocks, block_size, heads, dim]");
  const int64_t heads = pool.size(2), d = pool.size(3), capacity = pool.size(0) * pool.size(1);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.numel() == tokens * heads * d, "write_kv: x must be bf16 [", tokens,
              ", ", heads, ", ", d, "]");
  const Fmt fmt = kv::format_of(pool);
  if (fmt != Fmt::kBf16)
    TORCH_CHECK(scales.defined() && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                    scales.numel() == capacity * heads,
                "write_kv: a quantized pool needs its contiguous fp32 scales [blocks, block_size, heads, 1]");
  const at::Tensor xc = x.contiguous();
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  auto* base = static_cast<uint8_t*>(pool.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = slots[t];
    TORCH_CHECK(slot >= 0 && slot < capacity, "write_kv: slot ", slot, " out of range");
    const uint16_t* row = xp + t * heads * d;
    uint8_t* dst = base + slot * heads * d * kv::code_bytes(fmt);
    float* s = fmt == Fmt::kBf16 ? nullptr : scales.data_ptr<float>() + slot * heads;
    switch (fmt) {
      case Fmt::kBf16: std::memcpy(dst, row, heads * d * 2); break;
      case Fmt::kInt8: quantize_rows<Fmt::kInt8>(row, heads, d, dst, s); break;
      case Fmt::kE4m3: quantize_rows<Fmt::kE4m3>(row, heads, d, dst, s); break;
      case Fmt::kE5m2: quantize_rows<Fmt::kE5m2>(row, heads, d, dst, s); break;
    }
  }
}

// The op: x [T, heads, dim] at flat `slots` [T] (int64) of `pool`, its scales into `scales` (quantized pools).
void kv_write(const at::Tensor& pool, const std::optional<at::Tensor>& scales, const at::Tensor& slots,
              const at::Tensor& x) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1, "kv_write: slots must be int64 [T]");
  const at::Tensor s = slots.contiguous();
  write_kv(pool, scales.value_or(at::Tensor()), s.data_ptr<int64_t>(), s.size(0), x);
}

}  // namespace edgeinfer_cpu

TORCH_LIBRARY_FRAGMENT(edgeinfer_cpu, m) { m.def("kv_write(Tensor(a!) pool, Tensor(b!)? scales, Tensor slots, Tensor x) -> ()"); }

TORCH_LIBRARY_IMPL(edgeinfer_cpu, CPU, m) { m.impl("kv_write", edgeinfer_cpu::kv_write); }
