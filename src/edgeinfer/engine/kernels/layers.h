// What the one-call steps (dense_step.cpp, moe_block.cpp) are built of: tensors and numbers passed from
// Python by name, and a layer's linear and norm as the eager path computes them.

#pragma once

#include "ops.h"

#include <ATen/ATen.h>
#include <torch/custom_class.h>

#include <string>

namespace edgeinfer_cpu::step {

using Tensors = c10::Dict<std::string, at::Tensor>;
using Numbers = c10::Dict<std::string, double>;

inline at::Tensor get(const Tensors& t, const std::string& name) {
  TORCH_CHECK(t.contains(name), "decode step: no tensor '", name, "'");
  return t.at(name);
}

inline double number(const Numbers& c, const std::string& name) {
  TORCH_CHECK(c.contains(name), "decode step: no number '", name, "'");
  return c.at(name);
}

// How the eager path splits work between our kernels and ATen's (kernels/bf16.py GEMV_ROWS,
// model/layers/kernel_ops.py MAX_ELEMENTS).
struct Limits {
  int64_t gemv_rows = 0, max_elements = 0;
};

// y = x @ W^T (+ b), as GemvLinear (a bf16 weight: bf16_gemv up to `gemv_rows` rows, else ATen's linear),
// LosslessLinear (the same in the lossless form: lossless_gemv, else ATen's linear on the decoded weight)
// and QuantLinear's cpu_w4a8 kernel (int4 codes: int4_gemv) multiply.
struct Linear {
  at::Tensor weight, codes, scales, zero_terms, bias;
  at::Tensor low_bytes, planes, escapes, offsets, table;  // a lossless form (kernels/lossless.py)
  int64_t group = 0;

  Linear() = default;
  Linear(const Tensors& t, const Numbers& c, const std::string& name) {
    if (t.contains(name + ".weight")) {
      weight = t.at(name + ".weight");
      TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2, name, ": weight must be bf16 [N, K]");
    } else if (t.contains(name + ".planes")) {
      low_bytes = get(t, name + ".low_bytes");
      planes = get(t, name + ".planes");
      escapes = get(t, name + ".escapes");
      offsets = get(t, name + ".offsets");
      table = get(t, name + ".table");
    } else {
      codes = get(t, name + ".codes");
      scales = get(t, name + ".scales");
      zero_terms = get(t, name + ".zero_terms");
      group = static_cast<int64_t>(number(c, name + ".group"));
    }
    if (t.contains(name + ".bias")) bias = t.at(name + ".bias");
  }

  at::Tensor operator()(const at::Tensor& x, const Limits& lim) const {
    if (planes.defined()) return lossless(x, lim);
    if (weight.defined() && x.size(0) > lim.gemv_rows) return at::linear(x, weight, bias);
    at::Tensor y = weight.defined() ? edgeinfer_cpu::bf16_gemv(x, weight)
                                    : edgeinfer_cpu::int4_gemv(x.contiguous(), codes, scales, zero_terms, group);
    return bias.defined() ? y + bias.to(y.scalar_type()) : y;
  }

  at::Tensor lossless(const at::Tensor& x, const Limits& lim) const {
    if (x.size(0) > lim.gemv_rows)
      return at::linear(x, edgeinfer_cpu::lossless_decode(x.size(1), low_bytes, planes, escapes, offsets, table),
                        bias);
    const at::Tensor y = edgeinfer_cpu::lossless_gemv(x, low_bytes, planes, escapes, offsets, table);
    return bias.defined() ? y + bias.to(y.scalar_type()) : y;
  }
};

// RMSNorm as model/layers/norm.py computes it: `weight` is Gemma's fp32 `1 + w` (the scale applied in
// fp32) or a bf16 weight (`round_first`: the normalised rows rounded to bf16 before it multiplies them).
struct Norm {
  at::Tensor weight;
  double eps = 0;
  bool round_first = false;

  Norm() = default;
  Norm(const Tensors& t, const Numbers& c, const std::string& name)
      : weight(get(t, name)), eps(number(c, name + ".eps")), round_first(number(c, name + ".round_first") != 0) {}

  at::Tensor operator()(const at::Tensor& x, const Limits& lim) const {
    if (x.numel() <= lim.max_elements) return edgeinfer_cpu::rms_norm(x.contiguous(), weight, eps, round_first);
    const int64_t d = x.size(-1);
    const at::IntArrayRef shape(&d, 1);
    if (round_first) return weight * at::rms_norm(x.to(at::kFloat), shape, std::nullopt, eps).to(x.scalar_type());
    return at::rms_norm(x.to(at::kFloat), shape, weight, eps).to(x.scalar_type());
  }
};

}  // namespace edgeinfer_cpu::step
