"""LoRA adapters (engine/lora/): PEFT's outputs in fp32, mixed batches, prefix-cache isolation, and the
checks at registration."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers.lora import make_adapter, peft_greedy, peft_logprobs
from safetensors.torch import save_file

from edgeinfer.engine import kernels
from edgeinfer.engine.errors import EngineInputError
from edgeinfer.engine.lora import AdapterError, UnknownAdapterError
from edgeinfer.types import SamplingParams

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11], [300, 301, 5, 6]]
N = 10
GREEDY = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, logprobs=1)
# per family: which projections, rank, alpha, rslora (every projection is covered by some family)
ADAPTERS = {
    "llama": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 8, 16, False),
    "qwen3": (["q_proj", "v_proj", "down_proj"], 4, 8, True),
    "gemma3": (["k_proj", "o_proj", "gate_proj", "up_proj"], 16, 32, False),
}


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory):
    """Per family: (adapter directory, its PEFT model)."""
    root = tmp_path_factory.mktemp("adapters")
    made = {}
    for family, (targets, r, alpha, rslora) in ADAPTERS.items():
        out = root / family
        made[family] = (out, make_adapter(tiny_models[family], out, targets, r, alpha, rslora))
    return made


@pytest.fixture(scope="module")
def llama_adapters(tiny_models, tmp_path_factory):
    """Three different adapters of the tiny Llama: (directory, PEFT model) each."""
    root = tmp_path_factory.mktemp("llama_adapters")
    specs = [
        (["q_proj", "v_proj"], 4, 8, False),
        (["gate_proj", "down_proj"], 8, 8, True),
        (["o_proj"], 2, 4, False),
    ]
    return [
        (root / f"a{i}", make_adapter(tiny_models["llama"], root / f"a{i}", *spec, seed=i + 1))
        for i, spec in enumerate(specs)
    ]


def answers(engine, prompts, adapters):
    done = engine.generate(prompts, GREEDY, adapters)
    return [(c.token_ids, [lp.logprob for o in c.outputs for lp in o.logprobs]) for c in done]


@pytest.mark.parametrize("family", list(ADAPTERS))
def test_greedy_tokens_and_logprobs_match_peft(family, tiny_models, adapters, engine_factory):
    path, peft_model = adapters[family]
    engine = engine_factory(tiny_models[family])
    engine.load_adapter("mine", path)
    base = answers(engine, PROMPTS, None)
    ours = answers(engine, PROMPTS, "mine")
    for prompt, (tokens, logprobs), (base_tokens, _) in zip(PROMPTS, ours, base, strict=True):
        assert tokens == peft_greedy(peft_model, prompt, N)
        assert tokens != base_tokens  # the adapter changes the answer: it is applied, not a no-op
        ref = peft_logprobs(peft_model, prompt + tokens)
        expected = [ref[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]
        assert logprobs == pytest.approx(expected, abs=1e-4)


def test_a_batch_of_three_adapters_and_the_base_gives_each_its_answer_alone(
    tiny_models, llama_adapters, engine_factory
):
    engine = engine_factory(tiny_models["llama"])
    for i, (path, _) in enumerate(llama_adapters):
        engine.load_adapter(f"a{i}", path)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[1], [9, 8, 7, 6, 5, 4, 3], PROMPTS[0], [44, 45]]
    names = ["a0", None, "a0", "a1", "a2", None]  # a0's rows are not contiguous: the gathered product
    together = answers(engine, prompts, names)
    alone = [answers(engine, [p], [n])[0] for p, n in zip(prompts, names, strict=True)]
    for (t_tokens, t_lps), (a_tokens, a_lps) in zip(together, alone, strict=True):
        assert t_tokens == a_tokens
        assert t_lps == pytest.approx(a_lps, abs=1e-4)
    # and each answer is its adapter's, as PEFT computes it
    for prompt, name, (tokens, _) in zip(prompts, names, together, strict=True):
        if name is not None:
            assert tokens == peft_greedy(llama_adapters[int(name[1])][1], prompt, N)


def test_same_prompt_under_different_adapters_never_shares_cached_blocks(
    tiny_models, llama_adapters, engine_factory
):
    engine = engine_factory(tiny_models["llama"])
    engine.load_adapter("a0", llama_adapters[0][0])
    engine.load_adapter("a1", llama_adapters[1][0])
    prompt = list(range(10, 31))  # 5 whole blocks of 4 cached after a first run
    one = SamplingParams(max_tokens=1, temperature=0.0)

    def hits(adapter):
        before = engine.stats().prefix_cache_hits
        engine.generate([prompt], one, adapter)
        return engine.stats().prefix_cache_hits - before

    assert hits("a0") == 0
    assert hits("a1") == 0
    assert hits(None) == 0
    assert hits("a0") == 20 and hits("a1") == 20 and hits(None) == 20  # each its own blocks


def test_adapter_requests_skip_public_prefixes_the_base_computed(tiny_models, llama_adapters, engine_factory):
    text = "The quick brown fox jumps over the lazy dog. Paged attention stores keys."
    engine = engine_factory(tiny_models["llama"], public_prefixes=(text,))
    engine.load_adapter("a0", llama_adapters[0][0])
    prompt = engine.tokenizer.encode(text + " Hello")
    before = engine.stats().prefix_cache_hits
    engine.generate([prompt], SamplingParams(max_tokens=1), "a0")
    assert engine.stats().prefix_cache_hits == before
    engine.generate([prompt], SamplingParams(max_tokens=1))
    assert engine.stats().prefix_cache_hits > before


@pytest.mark.parametrize("quantization", [None, "int4"], ids=["bf16", "int4"])
@pytest.mark.parametrize("family", list(ADAPTERS))
def test_the_fused_decode_step_adds_the_deltas_as_the_eager_path_bit_for_bit(
    family, quantization, tiny_models, adapters, llama_adapters
):
    """bf16 (or int4) on our kernels: decode steps with adapter rows take the fused step, alone and in
    batches mixing adapters and the base (one adapter's rows not contiguous), and its tokens and logprobs
    equal the eager path's (the hooks' same `lora_add` calls) bit for bit."""
    from helpers.fused_step import assert_fused_step_decodes_as_eager, bf16_engine

    if not kernels.cpu_has_avx2():
        pytest.skip("bf16 models keep torch's kernels without AVX2")
    engine = bf16_engine(tiny_models[family], quantization=quantization, calibrate_quantization=False)
    engine.load_adapter("mine", adapters[family][0])
    prompts = [PROMPTS[0], PROMPTS[1], [9, 8, 7, 6, 5, 4, 3], [44, 45]]
    names = ["mine", None, "mine", None]
    if family == "llama":  # adapters on other modules, several in one step
        for i, (path, _) in enumerate(llama_adapters):
            engine.load_adapter(f"a{i}", path)
        prompts += [PROMPTS[0], [60, 61, 62]]
        names = ["mine", "a0", "a2", None, "a0", "a1"]
    assert_fused_step_decodes_as_eager(engine, prompts, N, names)


def test_speculative_decoding_verifies_drafts_through_the_adapter(
    tiny_models, llama_adapters, engine_factory
):
    """Draft rows of an adapter request carry its delta: the tokens are those of plain decoding."""
    prompt = [5, 6, 7, 8, 9] * 4
    plain = engine_factory(tiny_models["llama"])
    spec = engine_factory(tiny_models["llama"], speculative_method="ngram")
    for engine in (plain, spec):
        engine.load_adapter("a0", llama_adapters[0][0])
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    (expected,), (got,) = (e.generate([prompt], sp, "a0") for e in (plain, spec))
    assert sum(spec.stats().spec_drafted_by_source.values()) > 0
    assert got.token_ids == expected.token_ids


# ---- registration ----------------------------------------------------------------------------------


@pytest.fixture
def llama_engine(tiny_models, engine_factory):
    return engine_factory(tiny_models["llama"])


@pytest.fixture
def adapter_copy(adapters, tmp_path):
    """A copy of the Llama adapter to spoil."""
    out = tmp_path / "adapter"
    shutil.copytree(adapters["llama"][0], out)
    return out


def _edit_config(path, **changes):
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def _refused(engine, path, match):
    with pytest.raises(AdapterError, match=match) as e:
        engine.load_adapter("bad", path)
    assert "\n" not in str(e.value)
    assert engine.adapters.names() == []


def test_malformed_configs_are_refused(llama_engine, adapter_copy):
    good = (adapter_copy / "adapter_config.json").read_text()
    (adapter_copy / "adapter_config.json").write_text("{not json")
    _refused(llama_engine, adapter_copy, "not valid JSON")
    (adapter_copy / "adapter_config.json").write_text(good)
    for changes, match in [
        ({"peft_type": "IA3"}, "peft_type"),
        ({"r": "8"}, "r must be"),
        ({"lora_alpha": -1}, "lora_alpha"),
        ({"use_dora": True}, "DoRA"),
        ({"target_modules": ".*proj"}, "regular expression"),
    ]:
        _edit_config(
            adapter_copy, peft_type="LORA", r=8, lora_alpha=16, use_dora=False, target_modules=["q_proj"]
        )
        _edit_config(adapter_copy, **changes)
        _refused(llama_engine, adapter_copy, match)
    (adapter_copy / "adapter_config.json").unlink()
    _refused(llama_engine, adapter_copy, "no adapter_config.json")


def test_rank_over_64_is_refused(llama_engine, adapter_copy):
    _edit_config(adapter_copy, r=128)
    _refused(llama_engine, adapter_copy, "rank r=128 is over the limit of 64")


def test_a_target_module_the_base_lacks_is_refused(llama_engine, adapter_copy):
    _edit_config(adapter_copy, target_modules=["q_proj", "fc1"])
    _refused(llama_engine, adapter_copy, "target module 'fc1'")
    _edit_config(adapter_copy, target_modules=["q_proj"])
    save_file(
        {
            "base_model.model.model.layers.0.mlp.fc1.lora_A.weight": torch.zeros(8, 64),
            "base_model.model.model.layers.0.mlp.fc1.lora_B.weight": torch.zeros(64, 8),
        },
        adapter_copy / "adapter_model.safetensors",
    )
    _refused(llama_engine, adapter_copy, "mlp.fc1 is not one of this base's projections")


def test_an_adapter_of_another_base_is_refused(llama_engine, adapters):
    _refused(
        llama_engine,
        adapters["qwen3"][0],
        r"lora_B of layers.0.q_proj is \[128, 4\], the base needs \[64, 4\]",
    )
    _refused(llama_engine, adapters["gemma3"][0], "the base has 2 layers|the base needs")


def test_an_oversized_file_is_refused(llama_engine, adapters):
    llama_engine.adapters.max_file_bytes = 1000
    _refused(llama_engine, adapters["llama"][0], "bytes, over the limit of 1000")


def test_an_unknown_adapter_fails_the_request_clearly(llama_engine):
    with pytest.raises(UnknownAdapterError, match="adapter 'nope' does not exist"):
        llama_engine.generate([PROMPTS[0]], GREEDY, "nope")
    assert issubclass(UnknownAdapterError, EngineInputError)


def test_lru_budget_evicts_unpinned_idle_adapters_and_reloads_on_demand(llama_engine, llama_adapters):
    reg = llama_engine.adapters
    llama_engine.load_adapter("a0", llama_adapters[0][0], pin=True)
    llama_engine.load_adapter("a1", llama_adapters[1][0])
    reg.budget_bytes = reg.resident_bytes()  # room for exactly these two
    llama_engine.load_adapter("a2", llama_adapters[2][0])
    assert reg.resident() == ["a0", "a2"]  # a1, least recently used and unpinned, went
    ((tokens, _),) = answers(llama_engine, [PROMPTS[0]], "a1")  # reloaded on demand
    assert tokens == peft_greedy(llama_adapters[1][1], PROMPTS[0], N)
    assert "a1" in reg.resident() and "a0" in reg.resident()
    llama_engine.unload_adapter("a1")
    assert reg.names() == ["a0", "a2"]


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_the_delta_lands_on_quantized_base_layers_at_the_adapters_rows(
    quantization, tiny_models, llama_adapters
):
    """int8/int4 base weights: the hook adds x @ A.T @ B.T * scale to the quantized product's output, at
    the adapter's rows only (contiguous and gathered alike); and steps with adapter rows run eagerly."""
    from helpers.fused_step import bf16_engine
    from safetensors.torch import load_file

    from edgeinfer.engine.quant.layers import QuantLinear

    engine = bf16_engine(tiny_models["llama"], quantization=quantization, calibrate_quantization=False)
    path = llama_adapters[0][0]  # q_proj and v_proj, r=4, alpha=8
    weights = engine.adapters.register("a0", path)
    module = engine.model.model.layers[1].self_attn.qkv_proj
    assert isinstance(module, QuantLinear)
    runtime = engine.adapters.runtime
    runtime.install()
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.inference_mode():
        runtime.begin({})
        base = module(x).float()
        runtime.begin({"a0": (weights, [(1, 3), (4, 5)])})
        got = module(x).float()
    raw = load_file(path / "adapter_model.safetensors")
    key = "base_model.model.model.layers.1.self_attn.{}_proj.lora_{}.weight"
    delta = torch.zeros(6, 128)
    for proj, cols in (("q", slice(0, 64)), ("v", slice(96, 128))):
        a, b = raw[key.format(proj, "A")], raw[key.format(proj, "B")]
        delta[:, cols] = x.float() @ a.T @ b.T * (8 / 4)
    delta[[0, 3, 5]] = 0.0
    assert torch.allclose(got - base, delta, atol=0.05, rtol=0.05)
    assert (got - base)[[0, 3, 5]].abs().max() == 0
    assert delta.abs().max() > 1.0  # large against the tolerance


def test_calibrated_quantization_refuses_adapters(tiny_models, llama_adapters):
    from helpers.fused_step import bf16_engine

    engine = bf16_engine(tiny_models["llama"], quantization="int8")
    with pytest.raises(AdapterError, match="without calibration"):
        engine.load_adapter("a0", llama_adapters[0][0])
