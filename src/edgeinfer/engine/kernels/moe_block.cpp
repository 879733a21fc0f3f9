// A sparse MoE block (router, routed experts, shared expert) in one call, for every step that runs it.
//
// In Python the block is ~25 torch calls, most of them over a handful of values: the router's scoring and
// top-k, a sort of the (token, slot) pairs by expert, a grouped GEMM that visits every expert, the scatter
// back and the weighted sum. Here the router scores each token in a loop, the pairs are counted into expert
// order, each chosen expert multiplies all its tokens' rows at once through our kernels (bf16 tiles, or the
// int4 W4A8 kernel), reading its weights once per call, and the combine is one pass. Each row's result
// depends on that row alone (the kernels keep one summation order per output up to GEMV_ROWS rows), so a
// token's output is the same whatever it is batched with.
//
// Rounding follows model/moe.py and model/routing.py: expert outputs in bf16, each weighted output rounded
// to bf16, the k of them summed in fp32 and rounded once, the shared expert added in bf16; softmax weights
// are kept as bf16 values, sigmoid weights in fp32.

#include "moe_block.h"

#include "isa.h"
#include "ops.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

namespace edgeinfer_cpu {

namespace {

using step::number;

constexpr int64_t kLosslessGroup = 16;  // rows per escape offset of a lossless form (kernels/lossless.py GROUP)

inline float round_bf16(float f) { return static_cast<float>(c10::BFloat16(f)); }

// The `keep` best of `n` indices by `score` (higher first, the lower index first among equals).
void best(const float* score, int64_t n, int64_t keep, int64_t* out, std::vector<int64_t>& order) {
  order.resize(n);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + keep, order.end(), [score](int64_t a, int64_t b) {
    return score[a] > score[b] || (score[a] == score[b] && a < b);
  });
  std::copy(order.begin(), order.begin() + keep, out);
}

// DeepSeek-V3's group-limited selection: only the `keep` groups whose two best choices sum highest compete.
void keep_best_groups(float* choice, int64_t experts, int64_t groups, int64_t keep, std::vector<int64_t>& order) {
  const int64_t size = experts / groups;
  std::vector<float> group_score(groups);
  int64_t top2[2];
  for (int64_t g = 0; g < groups; ++g) {
    best(choice + g * size, size, 2, top2, order);
    group_score[g] = choice[g * size + top2[0]] + choice[g * size + top2[1]];
  }
  std::vector<int64_t> kept(keep);
  best(group_score.data(), groups, keep, kept.data(), order);
  for (int64_t g = 0; g < groups; ++g)
    if (std::find(kept.begin(), kept.end(), g) == kept.end())
      std::fill(choice + g * size, choice + (g + 1) * size, -std::numeric_limits<float>::infinity());
}

// One token's scores (`score`) and selection keys (`choice`) from its fp32 logits.
void score_row(const Router& r, const float* logits, int64_t experts, float* score, float* choice) {
  if (r.sigmoid) {
    const float* bias = r.bias.data_ptr<float>();
    for (int64_t e = 0; e < experts; ++e) {
      score[e] = 1.f / (1.f + std::exp(-logits[e]));
      choice[e] = score[e] + bias[e];
    }
  } else {
    const float mx = *std::max_element(logits, logits + experts);
    float sum = 0.f;
    for (int64_t e = 0; e < experts; ++e) sum += (score[e] = std::exp(logits[e] - mx));
    for (int64_t e = 0; e < experts; ++e) choice[e] = score[e] /= sum;
  }
  for (int64_t e = 0; e < experts; ++e)  // a NaN never wins (the engine reports non-finite logits itself)
    if (std::isnan(choice[e])) choice[e] = -std::numeric_limits<float>::infinity();
}

#if EDGEINFER_X86
// out[c] = bf16(sum_j bf16(w[j] * y_j[c])) for 16 columns at a time (the scalar loop below, vectorised).
EDGEINFER_TARGET_AVX512 void combine_row_avx512(const uint16_t* const* y, const float* w, int64_t k, int64_t h,
                                                uint16_t* out) {
  int64_t c = 0;
  for (; c + 16 <= h; c += 16) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; ++j)
      acc = _mm512_add_ps(acc, round_bf16x16(_mm512_mul_ps(_mm512_set1_ps(w[j]), bf16x16_to_fp32(y[j] + c))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), bf16_bits(acc));
  }
  for (; c < h; ++c) {
    float acc = 0.f;
    for (int64_t j = 0; j < k; ++j) acc += round_bf16(w[j] * bf16_bits_to_float(y[j][c]));
    out[c] = c10::BFloat16(acc).x;
  }
}
#endif

void combine_row(const uint16_t* const* y, const float* w, int64_t k, int64_t h, uint16_t* out) {
#if EDGEINFER_X86
  if (isa_allows(Isa::kAvx512)) return combine_row_avx512(y, w, k, h, out);
#endif
  for (int64_t c = 0; c < h; ++c) {
    float acc = 0.f;
    for (int64_t j = 0; j < k; ++j) acc += round_bf16(w[j] * bf16_bits_to_float(y[j][c]));
    out[c] = c10::BFloat16(acc).x;
  }
}

const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }

}  // namespace

ExpertStack::ExpertStack(const step::Tensors& t, const step::Numbers& c, const std::string& name) {
  if (t.contains(name + ".weight")) {
    weight = t.at(name + ".weight");
    TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 3 && weight.is_contiguous(), name,
                ": expert weights must be contiguous bf16 [E, N, K]");
    return;
  }
  if (t.contains(name + ".planes")) {
    low_bytes = step::get(t, name + ".low_bytes");
    planes = step::get(t, name + ".planes");
    escapes = step::get(t, name + ".escapes");
    offsets = step::get(t, name + ".offsets");
    table = step::get(t, name + ".table");
    lossless_experts = static_cast<int64_t>(number(c, name + ".experts"));
    TORCH_CHECK(lossless_experts > 0 && low_bytes.size(0) % (kLosslessGroup * lossless_experts) == 0, name,
                ": a lossless expert stack's experts must each start a group of escape offsets");
    return;
  }
  codes = step::get(t, name + ".codes");
  scales = step::get(t, name + ".scales");
  zero_terms = step::get(t, name + ".zero_terms");
  group = static_cast<int64_t>(number(c, name + ".group"));
  TORCH_CHECK(codes.dim() == 4 && codes.is_contiguous() && scales.is_contiguous() && zero_terms.is_contiguous(),
              name, ": int4 experts must be contiguous [E, N/16, K/8, 64] codes with [E, ...] scales");
}

at::Tensor ExpertStack::operator()(const at::Tensor& rows, int64_t e, const step::Limits& lim) const {
  if (lossless_experts) {
    // expert e's rows of the form: its low bytes and planes, and its groups' offsets into the shared list
    const int64_t n = low_bytes.size(0) / lossless_experts, k = rows.size(1);
    const at::Tensor low = low_bytes.narrow(0, e * n, n), bits = planes.narrow(0, e * n, n);
    const at::Tensor starts = offsets.narrow(0, e * n / kLosslessGroup, n / kLosslessGroup + 1);
    if (rows.size(0) > lim.gemv_rows) return at::linear(rows, lossless_decode(k, low, bits, escapes, starts, table));
    return lossless_gemv(rows, low, bits, escapes, starts, table);
  }
  const at::Tensor w = weight.select(0, e);
  return rows.size(0) > lim.gemv_rows ? at::linear(rows, w) : bf16_gemv(rows, w);
}

at::Tensor ExpertStack::grouped(const at::Tensor& x, const std::vector<int64_t>& start) const {
  return int4_gemv_grouped(x, codes, scales, zero_terms, start, group);
}

std::pair<at::Tensor, at::Tensor> Router::operator()(const at::Tensor& x) const {
  const int64_t t = x.size(0), experts = weight.size(0);
  const at::Tensor logits =
      (sigmoid ? at::linear(x.to(at::kFloat), weight) : at::linear(x, weight).to(at::kFloat)).contiguous();
  at::Tensor weights = at::empty({t, top_k}, x.options().dtype(at::kFloat));
  at::Tensor ids = at::empty({t, top_k}, x.options().dtype(at::kLong));
  const float* l = logits.data_ptr<float>();
  float* w = weights.data_ptr<float>();
  int64_t* id = ids.data_ptr<int64_t>();
  at::parallel_for(0, t, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> score(experts), choice(experts);
    std::vector<int64_t> order;
    for (int64_t r = t0; r < t1; ++r) {
      score_row(*this, l + r * experts, experts, score.data(), choice.data());
      if (sigmoid && topk_group < n_group) keep_best_groups(choice.data(), experts, n_group, topk_group, order);
      int64_t* picked = id + r * top_k;
      best(choice.data(), experts, top_k, picked, order);
      float total = 0.f;
      for (int64_t j = 0; j < top_k; ++j) total += score[picked[j]];
      for (int64_t j = 0; j < top_k; ++j) {
        float v = score[picked[j]];
        if (normalize) v = sigmoid ? v / (total + 1e-20f) : v / total;
        w[r * top_k + j] = sigmoid ? v * static_cast<float>(scaling) : round_bf16(v);
      }
    }
  });
  return {weights, ids};
}

MoeBlock::MoeBlock(step::Tensors t, step::Numbers c) {
  router_.weight = step::get(t, "router.weight");
  router_.sigmoid = number(c, "sigmoid") != 0;
  if (router_.sigmoid) router_.bias = step::get(t, "router.bias").to(at::kFloat).contiguous();
  TORCH_CHECK(router_.weight.scalar_type() == (router_.sigmoid ? at::kFloat : at::kBFloat16),
              "MoeBlock: the router weight must be fp32 for sigmoid scoring, bf16 for softmax");
  router_.top_k = static_cast<int64_t>(number(c, "top_k"));
  router_.normalize = number(c, "normalize") != 0;
  router_.n_group = static_cast<int64_t>(number(c, "n_group"));
  router_.topk_group = static_cast<int64_t>(number(c, "topk_group"));
  router_.scaling = number(c, "scaling");
  gate_up_ = ExpertStack(t, c, "gate_up");
  down_ = ExpertStack(t, c, "down");
  const int64_t experts = router_.weight.size(0);
  TORCH_CHECK(gate_up_.experts() == experts && down_.experts() == experts, "MoeBlock: experts and router differ");
  TORCH_CHECK(gate_up_.int4() == down_.int4(), "MoeBlock: both expert stacks must be bf16, or both int4");
  TORCH_CHECK(router_.top_k > 0 && router_.top_k <= experts && experts % router_.n_group == 0 &&
                  router_.topk_group <= router_.n_group,
              "MoeBlock: bad top_k or groups");
  // a shared expert in any form a Linear reads (bf16, lossless, int4)
  shared_ = t.contains("shared_gate_up.weight") || t.contains("shared_gate_up.planes") ||
            t.contains("shared_gate_up.codes");
  if (shared_) {
    shared_gate_up_ = step::Linear(t, c, "shared_gate_up");
    shared_down_ = step::Linear(t, c, "shared_down");
  }
  act_ = static_cast<int64_t>(number(c, "act"));
  limits_ = {static_cast<int64_t>(number(c, "gemv_rows")), static_cast<int64_t>(number(c, "max_elements"))};
}

at::Tensor MoeBlock::forward(at::Tensor x) const {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "MoeBlock: x must be bf16 [T, hidden]");
  x = x.contiguous();
  const auto [weights, ids] = router_(x);
  at::Tensor out = experts(x, weights, ids);
  if (shared_) out = out + shared_down_(gated_act(shared_gate_up_(x, limits_), act_), limits_);
  return out;
}

// int4 experts: every chosen expert's rows in one parallel region per projection (a parallel region per
// expert and projection costs more than an expert's int4 reads), each row as int4_gemv computes it.
void MoeBlock::int4_experts(const at::Tensor& x, const std::vector<int64_t>& start, const std::vector<int64_t>& pairs,
                            at::Tensor& pair_out) const {
  const int64_t k = router_.top_k, h = x.size(1), n = static_cast<int64_t>(pairs.size());
  at::Tensor tokens = at::empty({n}, x.options().dtype(at::kLong));
  int64_t* tp = tokens.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) tp[i] = pairs[i] / k;
  const at::Tensor rows = x.index_select(0, tokens);
  const at::Tensor y = down_.grouped(gated_act(gate_up_.grouped(rows, start), act_).contiguous(), start);
  const uint16_t* yb = bits(y);
  auto* po = reinterpret_cast<uint16_t*>(pair_out.data_ptr<at::BFloat16>());
  for (int64_t i = 0; i < n; ++i) std::memcpy(po + pairs[i] * h, yb + i * h, h * sizeof(uint16_t));
}

// bf16 experts: each chosen expert over all its rows at once (bf16_gemv, or torch's GEMM for many rows).
void MoeBlock::each_expert(const at::Tensor& x, const std::vector<int64_t>& start, const std::vector<int64_t>& pairs,
                           at::Tensor& pair_out) const {
  const int64_t k = router_.top_k, h = x.size(1);
  auto* po = reinterpret_cast<uint16_t*>(pair_out.data_ptr<at::BFloat16>());
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(start.size()); ++e) {
    const int64_t n = start[e + 1] - start[e];
    if (n == 0) continue;
    const int64_t* p = pairs.data() + start[e];
    at::Tensor rows;
    if (n == 1) {
      rows = x.narrow(0, p[0] / k, 1);
    } else {
      at::Tensor tokens = at::empty({n}, x.options().dtype(at::kLong));
      for (int64_t i = 0; i < n; ++i) tokens.data_ptr<int64_t>()[i] = p[i] / k;
      rows = x.index_select(0, tokens);
    }
    const at::Tensor y = down_(gated_act(gate_up_(rows, e, limits_), act_), e, limits_).contiguous();
    const uint16_t* yb = bits(y);
    for (int64_t i = 0; i < n; ++i) std::memcpy(po + p[i] * h, yb + i * h, h * sizeof(uint16_t));
  }
}

at::Tensor MoeBlock::experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids) const {
  const int64_t t = x.size(0), k = router_.top_k, h = x.size(1), experts = gate_up_.experts();
  // the (token, slot) pairs in expert order, in pair order within an expert (a counting sort)
  const int64_t* id = ids.data_ptr<int64_t>();
  std::vector<int64_t> start(experts + 1, 0), pairs(t * k);
  for (int64_t p = 0; p < t * k; ++p) ++start[id[p] + 1];
  std::partial_sum(start.begin(), start.end(), start.begin());
  std::vector<int64_t> cursor(start.begin(), start.end() - 1);
  for (int64_t p = 0; p < t * k; ++p) pairs[cursor[id[p]]++] = p;
  at::Tensor pair_out = at::empty({t * k, h}, x.options());
  auto* po = reinterpret_cast<uint16_t*>(pair_out.data_ptr<at::BFloat16>());
  if (gate_up_.int4())
    int4_experts(x, start, pairs, pair_out);
  else
    each_expert(x, start, pairs, pair_out);
  at::Tensor out = at::empty({t, h}, x.options());
  auto* ob = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float* w = weights.data_ptr<float>();
  at::parallel_for(0, t, std::max<int64_t>(1, 16384 / (h * k)), [&](int64_t t0, int64_t t1) {
    std::vector<const uint16_t*> rows(k);
    for (int64_t r = t0; r < t1; ++r) {
      for (int64_t j = 0; j < k; ++j) rows[j] = po + (r * k + j) * h;
      combine_row(rows.data(), w + r * k, k, h, ob + r * h);
    }
  });
  return out;
}

}  // namespace edgeinfer_cpu

TORCH_LIBRARY_FRAGMENT(edgeinfer_cpu, m) {
  m.class_<edgeinfer_cpu::MoeBlock>("MoeBlock")
      .def(torch::init<edgeinfer_cpu::step::Tensors, edgeinfer_cpu::step::Numbers>())
      .def("forward", &edgeinfer_cpu::MoeBlock::forward);
}
