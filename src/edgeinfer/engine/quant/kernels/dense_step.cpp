// Every layer of a dense decoder (Llama, Qwen3, Gemma 3) for one decode step of one sequence, in one call.
//
// At one sequence a step's ops are small, and from Python each costs its dispatch plus the interpreter
// between them: ~15 calls and a dozen module calls a layer. `DenseDecodeStep` holds each layer's weights,
// norms and KV pools and runs the kernels the eager path calls op by op (rms_norm, bf16_gemv or int4_gemv,
// rope, paged_decode_one, gated_act; ops.h), in the same order with the same roundings, so its hidden
// states are the eager path's bit for bit. The call runs without the GIL, so a server's event loop can
// stream the previous token while the whole step runs.
//
// Built from Python (model/fused_decode.py), one `add_layer` per layer: tensors by name, numbers by name.

#include "ops.h"

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <string>
#include <vector>

namespace {

using Tensors = c10::Dict<std::string, at::Tensor>;
using Numbers = c10::Dict<std::string, double>;

at::Tensor get(const Tensors& t, const std::string& name) {
  TORCH_CHECK(t.contains(name), "DenseDecodeStep.add_layer: no tensor '", name, "'");
  return t.at(name);
}

double number(const Numbers& c, const std::string& name) {
  TORCH_CHECK(c.contains(name), "DenseDecodeStep.add_layer: no number '", name, "'");
  return c.at(name);
}

// y = x @ W^T (+ b): a bf16 weight through bf16_gemv, or int4 codes through int4_gemv (W4A8), as
// GemvLinear and QuantLinear's cpu_w4a8 kernel multiply one row.
struct Linear {
  at::Tensor weight, codes, scales, zero_terms, bias;
  int64_t group = 0;

  Linear() = default;
  Linear(const Tensors& t, const Numbers& c, const std::string& name) {
    if (t.contains(name + ".weight")) {
      weight = t.at(name + ".weight");
      TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2, name, ": weight must be bf16 [N, K]");
    } else {
      codes = get(t, name + ".codes");
      scales = get(t, name + ".scales");
      zero_terms = get(t, name + ".zero_terms");
      group = static_cast<int64_t>(number(c, name + ".group"));
    }
    if (t.contains(name + ".bias")) bias = t.at(name + ".bias");
  }

  at::Tensor operator()(const at::Tensor& x) const {
    at::Tensor y = weight.defined() ? edgeinfer_cpu::bf16_gemv(x, weight)
                                    : edgeinfer_cpu::int4_gemv(x.contiguous(), codes, scales, zero_terms, group);
    return bias.defined() ? y + bias.to(y.scalar_type()) : y;
  }
};

// RMSNorm through rms_norm: `weight` is Gemma's fp32 `1 + w` or a bf16 weight (`round_first`).
struct Norm {
  at::Tensor weight;
  double eps = 0;
  bool round_first = false;

  Norm() = default;
  Norm(const Tensors& t, const Numbers& c, const std::string& name)
      : weight(get(t, name)), eps(number(c, name + ".eps")), round_first(number(c, name + ".round_first") != 0) {}

  at::Tensor operator()(const at::Tensor& x) const {
    return edgeinfer_cpu::rms_norm(x.contiguous(), weight, eps, round_first);
  }
};

struct Layer {
  Norm input, post_attention, pre_feedforward, post_feedforward, q_norm, k_norm;
  Linear qkv, o, gate_up, down;
  bool sandwich = false, qk_norm = false, interleaved = false;
  int64_t heads = 0, kv_heads = 0, head_dim = 0, rope = 0, rotary_dim = 0, window = 0, act = 0;
  double scale = 1;
  at::Tensor k_pool, v_pool;

  at::Tensor mlp(const at::Tensor& x) const { return down(edgeinfer_cpu::gated_act(gate_up(x), act)); }

  // x [1, hidden] -> the layer's output, as DecoderLayer.forward computes it.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t slot,
                     const at::Tensor& blocks, int64_t ctx) {
    const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;
    const at::Tensor qkv_out = qkv(input(x));
    at::Tensor q = qkv_out.narrow(1, 0, q_size).view({1, heads, head_dim});
    at::Tensor k = qkv_out.narrow(1, q_size, kv_size).view({1, kv_heads, head_dim});
    const at::Tensor v = qkv_out.narrow(1, q_size + kv_size, kv_size).view({1, kv_heads, head_dim});
    if (qk_norm) {
      q = q_norm(q);
      k = k_norm(k);
    }
    q = edgeinfer_cpu::rope(q, cos, sin, rotary_dim, interleaved);
    k = edgeinfer_cpu::rope(k, cos, sin, rotary_dim, interleaved);
    const at::Tensor attn = edgeinfer_cpu::paged_decode_one(q, k, v, k_pool, v_pool, slot, blocks, ctx, scale, window);
    const at::Tensor h = o(attn.reshape({1, q_size}));
    if (sandwich) {
      const at::Tensor mid = x + post_attention(h);
      return mid + post_feedforward(mlp(pre_feedforward(mid)));
    }
    const at::Tensor mid = x + h;
    return mid + mlp(post_attention(mid));
  }
};

class DenseDecodeStep : public torch::CustomClassHolder {
 public:
  // Tensors: the norms' weights (`input_norm`, `post_attention_norm`, with Gemma's sandwich also
  // `pre_feedforward_norm` and `post_feedforward_norm`, with QK-norm `q_norm` and `k_norm`), the linears
  // `qkv`, `o`, `gate_up`, `down` (`<name>.weight`, or `<name>.codes` / `.scales` / `.zero_terms`, and an
  // optional `<name>.bias`), the layer's `k_pool` and `v_pool`. Numbers: `<norm>.eps`, `<norm>.round_first`,
  // `<linear>.group` for int4, `heads`, `kv_heads`, `head_dim`, `rope` (which of `run`'s tables),
  // `rotary_dim`, `interleaved`, `scale`, `window` (0: global), `act` (gated_act's code).
  void add_layer(Tensors t, Numbers c) {
    Layer l;
    l.sandwich = t.contains("pre_feedforward_norm");
    l.qk_norm = t.contains("q_norm");
    l.input = Norm(t, c, "input_norm");
    l.post_attention = Norm(t, c, "post_attention_norm");
    if (l.sandwich) {
      l.pre_feedforward = Norm(t, c, "pre_feedforward_norm");
      l.post_feedforward = Norm(t, c, "post_feedforward_norm");
    }
    if (l.qk_norm) {
      l.q_norm = Norm(t, c, "q_norm");
      l.k_norm = Norm(t, c, "k_norm");
    }
    l.qkv = Linear(t, c, "qkv");
    l.o = Linear(t, c, "o");
    l.gate_up = Linear(t, c, "gate_up");
    l.down = Linear(t, c, "down");
    for (auto [field, name] : {std::pair{&l.heads, "heads"}, {&l.kv_heads, "kv_heads"}, {&l.head_dim, "head_dim"},
                               {&l.rope, "rope"}, {&l.rotary_dim, "rotary_dim"}, {&l.window, "window"},
                               {&l.act, "act"}})
      *field = static_cast<int64_t>(number(c, name));
    l.interleaved = number(c, "interleaved") != 0;
    l.scale = number(c, "scale");
    l.k_pool = get(t, "k_pool");
    l.v_pool = get(t, "v_pool");
    layers_.push_back(std::move(l));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x [1, hidden] bf16 (the scaled embedding) -> the last layer's output; `cos[i]` / `sin[i]`: the step's
  // bf16 tables of rope i, as RotaryEmbedding gathers them; `slot`: the new token's flat cache slot;
  // `blocks`: the sequence's block table; `ctx`: its length with the new token.
  at::Tensor run(at::Tensor x, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin, int64_t slot,
                 at::Tensor blocks, int64_t ctx) {
    TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.scalar_type() == at::kBFloat16,
                "DenseDecodeStep.run: x must be one bf16 row");
    TORCH_CHECK(cos.size() == sin.size(), "DenseDecodeStep.run: one sin table per cos table");
    for (Layer& l : layers_) {
      TORCH_CHECK(l.rope < static_cast<int64_t>(cos.size()), "DenseDecodeStep.run: no rope table ", l.rope);
      x = l.forward(x, cos[l.rope], sin[l.rope], slot, blocks, ctx);
    }
    return x;
  }

 private:
  std::vector<Layer> layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(edgeinfer_cpu, m) {
  m.class_<DenseDecodeStep>("DenseDecodeStep")
      .def(torch::init<>())
      .def("add_layer", &DenseDecodeStep::add_layer)
      .def("num_layers", &DenseDecodeStep::num_layers)
      .def("run", &DenseDecodeStep::run);
}
