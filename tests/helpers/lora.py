"""PEFT LoRA adapters on the tiny checkpoints, with random non-zero A and B (a real adapter)."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM


def make_adapter(
    base: str,
    out: Path,
    targets: list[str],
    r: int = 8,
    alpha: float = 16,
    rslora: bool = False,
    seed: int = 0,
) -> PeftModel:
    """Write a PEFT adapter for `base` into `out` and return the fp32 PEFT model that runs it."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets,
        use_rslora=rslora,
        lora_dropout=0.0,
        init_lora_weights=False,
    )
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # PEFT's default B is zero; here both are random, large enough to change tokens
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.2)
    peft_model.save_pretrained(out)
    return peft_model.eval()


def peft_greedy(model: PeftModel, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, max_new_tokens=n, do_sample=False, min_new_tokens=n, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def peft_logprobs(model: PeftModel, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0].float(), -1)
