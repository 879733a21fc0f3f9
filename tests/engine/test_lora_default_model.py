"""A LoRA adapter trained here, for a few steps with PEFT, on the real default model (Gemma 3 270M): the
engine serving it matches PEFT's model in fp32 (greedy tokens identical, logprobs within tolerance), and the
adapter is a real one (trained weights that move the logits), not PEFT's zero-initialised B."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.lora import peft_greedy, peft_logprobs
from peft import LoraConfig, PeftModel, get_peft_model

from edgeinfer.types import SamplingParams

pytestmark = pytest.mark.gemma

PROMPTS = ["The capital of France is"]
N = 6


@pytest.fixture(scope="module")
def trained(gemma_hf_fp32, tmp_path_factory) -> tuple[str, PeftModel]:
    """(adapter directory, the PEFT model that runs it), after a few steps of training on a fixed sequence."""
    base = copy.deepcopy(gemma_hf_fp32)  # the session's reference model stays as it is
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    model = get_peft_model(base, config)
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.tensor([[2, *range(1000, 1024)]])  # a fixed sequence: the loss falls on it
    model.train()
    for _ in range(2):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    out = tmp_path_factory.mktemp("gemma-lora") / "adapter"
    model.save_pretrained(out)
    return str(out), model.eval()


def test_a_trained_adapter_on_the_default_model_matches_peft(default_gguf, trained, engine_factory):
    path, peft_model = trained
    lora_b = [p for n, p in peft_model.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.abs().max() > 0 for p in lora_b)  # trained: PEFT starts B at zero
    engine = engine_factory(str(default_gguf), num_kv_blocks=64, block_size=16)
    engine.load_adapter("trained", path)
    tok = engine.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS] + [[2, *range(1000, 1010)]]
    greedy = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, logprobs=1)
    ours = engine.generate(prompts, greedy, "trained")
    base = engine.generate(prompts, greedy, None)
    moved = 0.0
    for prompt, mine, plain in zip(prompts, ours, base, strict=True):
        assert mine.token_ids == peft_greedy(peft_model, prompt, N), tok.decode(mine.token_ids)
        ref = peft_logprobs(peft_model, prompt + mine.token_ids)
        expected = [ref[len(prompt) - 1 + i, t].item() for i, t in enumerate(mine.token_ids)]
        got = [lp.logprob for o in mine.outputs for lp in o.logprobs]
        assert got == pytest.approx(expected, abs=2e-3)
        if plain.token_ids == mine.token_ids:
            base_lps = [lp.logprob for o in plain.outputs for lp in o.logprobs]
            moved = max(moved, max(abs(a - b) for a, b in zip(got, base_lps, strict=True)))
        else:
            moved = float("inf")
    assert moved > 1e-2  # the trained adapter changes what the model says
