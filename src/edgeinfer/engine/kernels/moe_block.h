// A sparse MoE block in one call: route each token to its top-k experts, run every chosen expert once over
// all the tokens routed to it, combine with the routing weights, add the shared expert (moe_block.cpp).

#pragma once

#include "layers.h"

#include <ATen/ATen.h>
#include <torch/custom_class.h>

#include <string>
#include <vector>

namespace edgeinfer_cpu {

// The experts of one projection, stacked [E, N, K]: a bf16 `weight`; the lossless form of its E * N rows
// (kernels/lossless.py LosslessExperts: expert e's rows start a group of escape offsets); or int4_gemv's
// `codes` / `scales` / `zero_terms` with a leading expert dimension.
struct ExpertStack {
  at::Tensor weight, codes, scales, zero_terms;
  at::Tensor low_bytes, planes, escapes, offsets, table;
  int64_t group = 0, lossless_experts = 0;

  ExpertStack() = default;
  ExpertStack(const step::Tensors& t, const step::Numbers& c, const std::string& name);
  int64_t experts() const {
    return weight.defined() ? weight.size(0) : lossless_experts ? lossless_experts : codes.size(0);
  }
  // bf16 or lossless: rows [n, K] @ expert e's weight^T -> [n, N] bf16
  at::Tensor operator()(const at::Tensor& rows, int64_t e, const step::Limits& lim) const;
  bool int4() const { return codes.defined(); }
  // int4 only: rows start[e] .. start[e + 1] of x [R, K] (bf16, contiguous) @ expert e's weight^T -> [R, N]
  at::Tensor grouped(const at::Tensor& x, const std::vector<int64_t>& start) const;
};

// Which experts each token goes to, with what weight (model/routing.py's two scorings).
struct Router {
  at::Tensor weight, bias;  // [E, H]: bf16 for softmax scoring, fp32 for sigmoid (with its fp32 bias [E])
  int64_t top_k = 0, n_group = 1, topk_group = 1;
  bool sigmoid = false, normalize = false;
  double scaling = 1.0;

  // x [T, H] bf16 -> weights [T, k] fp32 (softmax's rounded to bf16 values, as the eager path keeps
  // them) and expert ids [T, k] int64.
  std::pair<at::Tensor, at::Tensor> operator()(const at::Tensor& x) const;
};

class MoeBlock : public torch::CustomClassHolder {
 public:
  // Tensors: `router.weight` (+ `router.bias` for sigmoid scoring), the experts `gate_up` [E, 2I, H] and
  // `down` [E, H, I] (`.weight`, or `.codes` / `.scales` / `.zero_terms`), and optionally the shared
  // expert's linears `shared_gate_up` and `shared_down` (as layers.h's Linear reads them). Numbers:
  // `top_k`, `sigmoid`, `normalize`, `n_group`, `topk_group`, `scaling`, `act` (gated_act's code),
  // `<stack>.group` for int4, `gemv_rows` and `max_elements` (layers.h's Limits).
  MoeBlock(step::Tensors t, step::Numbers c);

  // x [T, H] bf16 -> [T, H] bf16
  at::Tensor forward(at::Tensor x) const;

 private:
  at::Tensor experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids) const;
  // Fill pair_out [T * k, H] with each (token, slot) pair's expert output; `start` and `pairs`: the pairs
  // in expert order (expert e's are pairs[start[e]] .. pairs[start[e + 1] - 1]).
  void int4_experts(const at::Tensor& x, const std::vector<int64_t>& start, const std::vector<int64_t>& pairs,
                    at::Tensor& pair_out) const;
  void each_expert(const at::Tensor& x, const std::vector<int64_t>& start, const std::vector<int64_t>& pairs,
                   at::Tensor& pair_out) const;

  Router router_;
  ExpertStack gate_up_, down_;
  step::Linear shared_gate_up_, shared_down_;
  bool shared_ = false;
  int64_t act_ = 0;
  step::Limits limits_;
};

}  // namespace edgeinfer_cpu
