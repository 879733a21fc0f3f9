// Every layer of a dense decoder (Llama, Qwen3, Gemma 3) for one decode step, in one call.
//
// In a decode step the ops are small, and from Python each costs its dispatch plus the interpreter
// between them: ~15 calls and a dozen module calls a layer. `DenseDecodeStep` holds each layer's weights,
// norms and KV pools and runs what the eager path runs, op for op and in the same order: our kernels
// (ops.h: rms_norm, bf16_gemv or int4_gemv, rope, gated_act, paged_decode) where the eager path takes them,
// the same ATen ops where it does not (wider products, inputs past `max_elements` values), so its hidden
// states are the eager path's bit for bit. The call runs without the GIL, so a server's event loop can
// stream the previous token while the whole step runs. LoRA adapters (engine/lora/) add their deltas to
// the outputs of qkv, o, gate_up and down by the same `lora_add` call that the eager path's hooks make.
//
// Built from Python (model/fused_decode.py), one `add_layer` per layer: tensors by name, numbers by name.

#include "layers.h"
#include "moe_block.h"
#include "ops.h"

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace {

using edgeinfer_cpu::step::get;
using edgeinfer_cpu::step::Limits;
using edgeinfer_cpu::step::Linear;
using edgeinfer_cpu::step::Norm;
using edgeinfer_cpu::step::number;
using edgeinfer_cpu::step::Numbers;
using edgeinfer_cpu::step::Tensors;

// Rotary embedding as model/layers/rotary.py applies it to x [T, H, D] with the step's tables [T, 1, w].
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

// The step's inputs every layer reads: the rope tables, the new tokens' cache slots [G, T] and the
// sequences' block tables [G, T, n] in each of the G KV groups (a layer reads its own group's row), and the
// sequences' context lengths [T] (one new token each), and the rows of the step's adapters (`lora_rows`,
// int64, each adapter's a segment of it: engine/lora/step.py).
struct StepInputs {
  const std::vector<at::Tensor>& cos;
  const std::vector<at::Tensor>& sin;
  const at::Tensor& slots;
  const at::Tensor& block_tables;
  const at::Tensor& ctx_lens;
  const at::Tensor& lora_rows;
};

// The modules of a layer that adapters target (engine/lora/targets.py), in `Layer::lora`'s order.
constexpr std::array<std::string_view, 4> kLoraModules = {"qkv", "o", "gate_up", "down"};
enum LoraModule { kQkv, kO, kGateUp, kDown };

// One module's `lora_add` call of the step: the A and B of each adapter of the step that targets it and
// their plan (none: no adapter of the step targets the module).
struct LoraSite {
  std::vector<at::Tensor> a, b;
  at::Tensor plan;

  // out (the module's fresh output) += the deltas of x (its input), as the eager path's forward hook adds them
  void add(at::Tensor& out, const at::Tensor& x, const at::Tensor& rows) const {
    if (plan.defined()) edgeinfer_cpu::lora_add(out, x, rows, a, b, plan);
  }
};

// DeepSeek-V3 / Kimi K2 multi-head latent attention as model/mla.py computes a decode: the query (full rank or
// through q_a, its norm and q_b), the latent [kv_a_norm(c) ; rope(k_pe)] written at the new tokens' slots,
// then mla_decode (the up-projection absorbed) and o.
struct Mla {
  Linear q, q_a, q_b, kv_a, o;
  Norm q_a_norm, kv_a_norm;
  at::Tensor kv_b, latent_pool;
  bool q_lora = false, interleaved = false;
  int64_t heads = 0, nope = 0, rope_dim = 0, v = 0, rank = 0, rope = 0;
  double scale = 1;

  Mla(const Tensors& t, const Numbers& c) {
    q_lora = t.contains("q_a_norm");
    if (q_lora) {
      q_a = Linear(t, c, "q_a");
      q_a_norm = Norm(t, c, "q_a_norm");
      q_b = Linear(t, c, "q_b");
    } else {
      q = Linear(t, c, "q");
    }
    kv_a = Linear(t, c, "kv_a");
    kv_a_norm = Norm(t, c, "kv_a_norm");
    o = Linear(t, c, "o");
    kv_b = get(t, "kv_b");
    latent_pool = get(t, "latent_pool");
    for (auto [field, name] : {std::pair{&heads, "heads"}, {&nope, "nope"}, {&rope_dim, "rotary_dim"}, {&v, "v_dim"},
                               {&rank, "rank"}, {&rope, "rope"}})
      *field = static_cast<int64_t>(number(c, name));
    interleaved = number(c, "interleaved") != 0;
    scale = number(c, "scale");
  }

  // h [T, hidden] (the normed input) -> the attention's output [T, hidden]
  at::Tensor operator()(const at::Tensor& h, const StepInputs& in, const Limits& lim) const {
    const int64_t t = h.size(0);
    const at::Tensor qs = (q_lora ? q_b(q_a_norm(q_a(h, lim), lim), lim) : q(h, lim)).view({t, heads, nope + rope_dim});
    const at::Tensor ckv = kv_a(h, lim);
    const at::Tensor &cos = in.cos[rope], &sin = in.sin[rope];
    const at::Tensor q_pe = rotate(qs.narrow(2, nope, rope_dim), cos, sin, rope_dim, interleaved, lim);
    const at::Tensor k_pe = rotate(ckv.narrow(1, rank, rope_dim).unsqueeze(1), cos, sin, rope_dim, interleaved, lim);
    const at::Tensor latent = at::cat({kv_a_norm(ckv.narrow(1, 0, rank), lim), k_pe.squeeze(1)}, 1);
    // latent attention has no window: its model has one KV group
    latent_pool.view({-1, rank + rope_dim}).index_copy_(0, in.slots.select(0, 0), latent);
    const at::Tensor attn = edgeinfer_cpu::mla_decode(qs.narrow(2, 0, nope), q_pe, latent_pool, kv_b,
                                                      in.block_tables.select(0, 0), in.ctx_lens, scale);
    return o(attn.reshape({t, heads * v}), lim);
  }
};

std::optional<at::Tensor> optional(const at::Tensor& t) { return t.defined() ? std::optional(t) : std::nullopt; }

struct Layer {
  Norm input, post_attention, pre_feedforward, post_feedforward, q_norm, k_norm;
  Linear qkv, o, gate_up, down;
  c10::intrusive_ptr<edgeinfer_cpu::MoeBlock> moe;  // set: the feed-forward is this sparse MoE block
  std::shared_ptr<Mla> mla;                          // set: the attention is latent (no GQA fields)
  bool sandwich = false, qk_norm = false, interleaved = false;
  int64_t heads = 0, kv_heads = 0, head_dim = 0, rope = 0, rotary_dim = 0, window = 0, act = 0, group = 0;
  double scale = 1;
  at::Tensor k_pool, v_pool, k_scales, v_scales;  // scales: an int8 / float8 cache's (kv_codes.h)
  std::array<LoraSite, kLoraModules.size()> lora;  // by LoraModule

  at::Tensor mlp(const at::Tensor& x, const StepInputs& in, const Limits& lim) const {
    if (moe) return moe->forward(x);
    at::Tensor gate_up_out = gate_up(x, lim);
    lora[kGateUp].add(gate_up_out, x, in.lora_rows);
    const at::Tensor gated = edgeinfer_cpu::gated_act(gate_up_out, act);
    at::Tensor out = down(gated, lim);
    lora[kDown].add(out, gated, in.lora_rows);
    return out;
  }

  // x [T, hidden] -> the layer's output, as DecoderLayer.forward (MoeDecoderLayer.forward) computes it.
  at::Tensor forward(const at::Tensor& x, const StepInputs& in, const Limits& lim) {
    if (mla) {
      const at::Tensor mid = x + (*mla)(input(x, lim), in, lim);
      return mid + mlp(post_attention(mid, lim), in, lim);
    }
    const int64_t t = x.size(0), q_size = heads * head_dim, kv_size = kv_heads * head_dim;
    const at::Tensor normed = input(x, lim);
    at::Tensor qkv_out = qkv(normed, lim);
    lora[kQkv].add(qkv_out, normed, in.lora_rows);
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
    const at::Tensor slots = in.slots.select(0, group).contiguous();
    edgeinfer_cpu::write_kv(k_pool, k_scales, slots.data_ptr<int64_t>(), t, k);
    edgeinfer_cpu::write_kv(v_pool, v_scales, slots.data_ptr<int64_t>(), t, v);
    const at::Tensor attn = edgeinfer_cpu::paged_decode(q, k_pool, v_pool, in.block_tables.select(0, group), in.ctx_lens,
                                                        scale, window, optional(k_scales), optional(v_scales));
    const at::Tensor attn_rows = attn.reshape({t, q_size});
    at::Tensor h = o(attn_rows, lim);
    lora[kO].add(h, attn_rows, in.lora_rows);
    if (sandwich) {
      const at::Tensor mid = x + post_attention(h, lim);
      return mid + post_feedforward(mlp(pre_feedforward(mid, lim), in, lim), lim);
    }
    const at::Tensor mid = x + h;
    return mid + mlp(post_attention(mid, lim), in, lim);
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
  // optional `<name>.bias`), the layer's `k_pool` and `v_pool` (bf16, or int8 / float8 codes with their
  // `k_scales` and `v_scales`). Numbers: `<norm>.eps`, `<norm>.round_first`, `<linear>.group` for int4,
  // `heads`, `kv_heads`, `head_dim`, `rope` (which of `run`'s tables), `rotary_dim`, `interleaved`,
  // `scale`, `window` (0: global), `act` (gated_act's code), `group` (the layer's KV group: which row of
  // `run`'s slots and block tables it reads).
  void add_layer(Tensors t, Numbers c) { layers_.push_back(make_layer(t, c, {})); }

  // A layer whose feed-forward is a sparse MoE block: as add_layer, without `gate_up` and `down`.
  void add_moe_layer(Tensors t, Numbers c, c10::intrusive_ptr<edgeinfer_cpu::MoeBlock> moe) {
    layers_.push_back(make_layer(t, c, std::move(moe)));
  }

  // x [T, hidden] bf16 (the scaled embeddings of T decoding sequences' new tokens) -> the last layer's
  // output; `cos[i]` / `sin[i]`: the step's bf16 tables of rope i, as RotaryEmbedding gathers them;
  // `slots` [G, T]: the new tokens' flat cache slots in each KV group; `block_tables` [G, T, n] and
  // `ctx_lens` [T] (int64): the sequences' blocks in each group and their lengths with the new token.
  // `stop`: an int32 flag another thread may set while the step runs; set before a layer, the step ends
  // there and returns no rows (its caller drops the step: runner/interrupt.py).
  at::Tensor run(at::Tensor x, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin, at::Tensor slots,
                 at::Tensor block_tables, at::Tensor ctx_lens, std::optional<at::Tensor> stop) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "DenseDecodeStep.run: x must be bf16 [T, hidden]");
    TORCH_CHECK(cos.size() == sin.size(), "DenseDecodeStep.run: one sin table per cos table");
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 2 && slots.size(1) == x.size(0),
                "DenseDecodeStep.run: slots must be int64 [G, T]");
    TORCH_CHECK(block_tables.dim() == 3 && block_tables.size(0) == slots.size(0),
                "DenseDecodeStep.run: block_tables must be [G, T, n], one table per group of slots");
    TORCH_CHECK(!stop || (stop->scalar_type() == at::kInt && stop->numel() == 1),
                "DenseDecodeStep.run: stop must be one int32");
    const volatile int32_t* stop_flag = stop ? stop->data_ptr<int32_t>() : nullptr;
    const StepInputs in{cos, sin, slots, block_tables, ctx_lens, lora_rows_};
    for (Layer& l : layers_) {
      if (stop_flag != nullptr && *stop_flag != 0) return x.new_empty({0, x.size(1)});
      TORCH_CHECK(l.rope < static_cast<int64_t>(cos.size()), "DenseDecodeStep.run: no rope table ", l.rope);
      TORCH_CHECK(l.group < slots.size(0), "DenseDecodeStep.run: no slots for KV group ", l.group);
      x = l.forward(x, in, limits_);
    }
    return x;
  }

  // The adapters of the steps to come, until set again (engine/lora/step.py's StepPlan): `rows`, the step's
  // adapter rows; per targeted module `layers[i]`'s `modules[i]` (qkv, o, gate_up or down), its `lora_add`
  // call's `a`, `b` and `plan`. Empty lists: no adapter rows. The tensors are held, not copied, so a plan
  // set once serves every step that has the same adapters on the same rows.
  void set_lora(at::Tensor rows, std::vector<int64_t> layers, std::vector<std::string> modules,
                std::vector<std::vector<at::Tensor>> a, std::vector<std::vector<at::Tensor>> b,
                std::vector<at::Tensor> plans) {
    const size_t n = layers.size();
    TORCH_CHECK(modules.size() == n && a.size() == n && b.size() == n && plans.size() == n,
                "DenseDecodeStep.set_lora: one module, A list, B list and plan per layer index");
    TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(),
                "DenseDecodeStep.set_lora: rows must be a contiguous int64 vector");
    std::vector<std::array<LoraSite, kLoraModules.size()>> sites(layers_.size());
    for (size_t i = 0; i < n; ++i) {
      TORCH_CHECK(0 <= layers[i] && layers[i] < static_cast<int64_t>(layers_.size()),
                  "DenseDecodeStep.set_lora: no layer ", layers[i]);
      const Layer& l = layers_[layers[i]];
      const auto found = std::find(kLoraModules.begin(), kLoraModules.end(), modules[i]);
      TORCH_CHECK(found != kLoraModules.end(), "DenseDecodeStep.set_lora: no module '", modules[i], "'");
      const auto m = static_cast<LoraModule>(found - kLoraModules.begin());
      TORCH_CHECK(m >= kGateUp ? !l.moe : !l.mla, "DenseDecodeStep.set_lora: layer ", layers[i], " has no ",
                  modules[i], " projection");
      sites[layers[i]][m] = LoraSite{std::move(a[i]), std::move(b[i]), std::move(plans[i])};
    }
    for (size_t i = 0; i < layers_.size(); ++i) layers_[i].lora = std::move(sites[i]);
    lora_rows_ = std::move(rows);
  }

 private:
  static Layer make_layer(const Tensors& t, const Numbers& c, c10::intrusive_ptr<edgeinfer_cpu::MoeBlock> moe) {
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
    l.moe = std::move(moe);
    if (c.contains("mla")) {
      l.mla = std::make_shared<Mla>(t, c);
      l.act = static_cast<int64_t>(number(c, "act"));
      if (!l.moe) {
        l.gate_up = Linear(t, c, "gate_up");
        l.down = Linear(t, c, "down");
      }
      return l;
    }
    l.qkv = Linear(t, c, "qkv");
    l.o = Linear(t, c, "o");
    if (!l.moe) {
      l.gate_up = Linear(t, c, "gate_up");
      l.down = Linear(t, c, "down");
    }
    for (auto [field, name] : {std::pair{&l.heads, "heads"}, {&l.kv_heads, "kv_heads"}, {&l.head_dim, "head_dim"},
                               {&l.rope, "rope"}, {&l.rotary_dim, "rotary_dim"}, {&l.window, "window"},
                               {&l.act, "act"}, {&l.group, "group"}})
      *field = static_cast<int64_t>(number(c, name));
    l.interleaved = number(c, "interleaved") != 0;
    l.scale = number(c, "scale");
    l.k_pool = get(t, "k_pool");
    l.v_pool = get(t, "v_pool");
    if (t.contains("k_scales")) {
      l.k_scales = get(t, "k_scales");
      l.v_scales = get(t, "v_scales");
    }
    return l;
  }

  std::vector<Layer> layers_;
  Limits limits_;
  at::Tensor lora_rows_ = at::empty({0}, at::kLong);
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(edgeinfer_cpu, m) {
  m.class_<DenseDecodeStep>("DenseDecodeStep")
      .def(torch::init<int64_t, int64_t>())
      .def("add_layer", &DenseDecodeStep::add_layer)
      .def("add_moe_layer", &DenseDecodeStep::add_moe_layer)
      .def("run", &DenseDecodeStep::run)
      .def("set_lora", &DenseDecodeStep::set_lora);
}
