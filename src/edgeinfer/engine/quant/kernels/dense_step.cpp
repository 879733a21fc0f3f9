// Every layer of a dense decoder (Llama, Qwen3, Gemma 3) for one decode step, in one call.
//
// In a decode step the ops are small, and from Python each costs its dispatch plus the interpreter
// between them: ~15 calls and a dozen module calls a layer. `DenseDecodeStep` holds each layer's weights,
// norms and KV pools and runs what the eager path runs, op for op and in the same order: our kernels
// (ops.h: rms_norm, bf16_gemv or int4_gemv, rope, gated_act, paged_decode) where the eager path takes them,
// the same ATen ops where it does not (wider products, inputs past `max_elements` values), so its hidden
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

// How the eager path splits work between our kernels and ATen's (kernels/bf16.py GEMV_ROWS,
// layers/kernel_ops.py MAX_ELEMENTS).
struct Limits {
  int64_t gemv_rows = 0, max_elements = 0;
};

// y = x @ W^T (+ b), as GemvLinear (a bf16 weight: bf16_gemv up to `gemv_rows` rows, else ATen's linear)
// and QuantLinear's cpu_w4a8 kernel (int4 codes: int4_gemv) multiply.
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

  at::Tensor operator()(const at::Tensor& x, const Limits& lim) const {
    if (weight.defined() && x.size(0) > lim.gemv_rows) return at::linear(x, weight, bias);
    at::Tensor y = weight.defined() ? edgeinfer_cpu::bf16_gemv(x, weight)
                                    : edgeinfer_cpu::int4_gemv(x.contiguous(), codes, scales, zero_terms, group);
    return bias.defined() ? y + bias.to(y.scalar_type()) : y;
  }
};

// RMSNorm as layers/norm.py computes it: `weight` is Gemma's fp32 `1 + w` (the scale applied in fp32) or
// a bf16 weight (`round_first`: the normalised rows rounded to bf16 before it multiplies them).
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

// Rotary embedding as layers/rotary.py applies it to x [T, H, D] with the step's tables [T, 1, w].
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t rd, bool interleaved,
                  const Limits& lim) {
  if (x.numel() <= lim.max_elements) return edgeinfer_cpu::rope(x, cos, sin, rd, interleaved);
  const at::Tensor rot = x.narrow(-1, 0, rd), rest = x.narrow(-1, rd, x.size(-1) - rd);
  at::Tensor out;
  if (interleaved) {
    const at::Tensor x1 = rot.slice(-1, 0, rd, 2), x2 = rot.slice(-1, 1, rd, 2);
    out = at::stack({x1 * cos - x2 * sin, x2 * cos + x1 * sin}, -1).flatten(-2);
  } else {
    const at::Tensor x1 = rot.narrow(-1, 0, rd / 2), x2 = rot.narrow(-1, rd / 2, rd / 2);
    out = rot * cos + at::cat({-x2, x1}, -1) * sin;
  }
  return rest.size(-1) == 0 ? out : at::cat({out, rest}, -1);
}

// act(gate) * up: the kernel for every size (it calls ATen's activation, as the torch form does).
// The step's inputs every layer reads: the rope tables, the new tokens' cache slots [T], the block
// tables [T, n] and context lengths [T] of the sequences (one new token each).
struct StepInputs {
  const std::vector<at::Tensor>& cos;
  const std::vector<at::Tensor>& sin;
  const at::Tensor& slots;
  const at::Tensor& block_tables;
  const at::Tensor& ctx_lens;
};

struct Layer {
  Norm input, post_attention, pre_feedforward, post_feedforward, q_norm, k_norm;
  Linear qkv, o, gate_up, down;
  bool sandwich = false, qk_norm = false, interleaved = false;
  int64_t heads = 0, kv_heads = 0, head_dim = 0, rope = 0, rotary_dim = 0, window = 0, act = 0;
  double scale = 1;
  at::Tensor k_pool, v_pool;

  at::Tensor mlp(const at::Tensor& x, const Limits& lim) const {
    return down(edgeinfer_cpu::gated_act(gate_up(x, lim), act), lim);
  }

  // x [T, hidden] -> the layer's output, as DecoderLayer.forward computes it.
  at::Tensor forward(const at::Tensor& x, const StepInputs& in, const Limits& lim) {
    const int64_t t = x.size(0), q_size = heads * head_dim, kv_size = kv_heads * head_dim;
    const at::Tensor qkv_out = qkv(input(x, lim), lim);
    at::Tensor q = qkv_out.narrow(1, 0, q_size).view({t, heads, head_dim});
    at::Tensor k = qkv_out.narrow(1, q_size, kv_size).view({t, kv_heads, head_dim});
    const at::Tensor v = qkv_out.narrow(1, q_size + kv_size, kv_size).view({t, kv_heads, head_dim});
    if (qk_norm) {
      q = q_norm(q, lim);
      k = k_norm(k, lim);
    }
    const at::Tensor &cos = in.cos[rope], &sin = in.sin[rope];
    q = rotate(q, cos, sin, rotary_dim, interleaved, lim);
    k = rotate(k, cos, sin, rotary_dim, interleaved, lim);
    k_pool.view({-1, kv_heads, head_dim}).index_copy_(0, in.slots, k);
    v_pool.view({-1, kv_heads, v_pool.size(3)}).index_copy_(0, in.slots, v);
    const at::Tensor attn = edgeinfer_cpu::paged_decode(q, k_pool, v_pool, in.block_tables, in.ctx_lens, scale, window);
    const at::Tensor h = o(attn.reshape({t, q_size}), lim);
    if (sandwich) {
      const at::Tensor mid = x + post_attention(h, lim);
      return mid + post_feedforward(mlp(pre_feedforward(mid, lim), lim), lim);
    }
    const at::Tensor mid = x + h;
    return mid + mlp(post_attention(mid, lim), lim);
  }
};

class DenseDecodeStep : public torch::CustomClassHolder {
 public:
  // The eager path's limits (Limits): products of more rows than `gemv_rows` go to ATen's linear, inputs
  // of more than `max_elements` values to ATen's norm and rotation.
  DenseDecodeStep(int64_t gemv_rows, int64_t max_elements) : limits_{gemv_rows, max_elements} {}

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

  // x [T, hidden] bf16 (the scaled embeddings of T decoding sequences' new tokens) -> the last layer's
  // output; `cos[i]` / `sin[i]`: the step's bf16 tables of rope i, as RotaryEmbedding gathers them;
  // `slots` [T]: the new tokens' flat cache slots; `block_tables` [T, n] and `ctx_lens` [T] (int64): the
  // sequences' blocks and lengths with the new token.
  at::Tensor run(at::Tensor x, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin, at::Tensor slots,
                 at::Tensor block_tables, at::Tensor ctx_lens) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "DenseDecodeStep.run: x must be bf16 [T, hidden]");
    TORCH_CHECK(cos.size() == sin.size(), "DenseDecodeStep.run: one sin table per cos table");
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == x.size(0),
                "DenseDecodeStep.run: slots must be int64 [T]");
    const StepInputs in{cos, sin, slots, block_tables, ctx_lens};
    for (Layer& l : layers_) {
      TORCH_CHECK(l.rope < static_cast<int64_t>(cos.size()), "DenseDecodeStep.run: no rope table ", l.rope);
      x = l.forward(x, in, limits_);
    }
    return x;
  }

 private:
  std::vector<Layer> layers_;
  Limits limits_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(edgeinfer_cpu, m) {
  m.class_<DenseDecodeStep>("DenseDecodeStep")
      .def(torch::init<int64_t, int64_t>())
      .def("add_layer", &DenseDecodeStep::add_layer)
      .def("run", &DenseDecodeStep::run);
}
