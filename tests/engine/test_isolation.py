"""One poisoned request in a batch fails alone: the others' tokens and text are those of a run without it."""

from __future__ import annotations

import math

import torch

from edgeinfer.engine.engine import LLMEngine
from edgeinfer.engine.kv_cache import NULL_BLOCK
from edgeinfer.engine.runner.inputs import build_inputs
from edgeinfer.types import EngineRequest, FinishReason, SamplingParams

GOOD = {
    "greedy": ([5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)),
    "seeded": (
        [20, 21, 22],
        SamplingParams(max_tokens=20, temperature=0.9, top_k=40, seed=7, ignore_eos=True),
    ),
    "seeded-long": (
        list(range(40, 75)),
        SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True),
    ),
}


class _ExplodingDetokenizer:
    def add(self, new_ids: list[int]) -> str:
        raise RuntimeError("detokenizer exploded")

    def flush(self) -> str:
        raise RuntimeError("detokenizer exploded")


def _run(eng: LLMEngine, poison: dict[str, object] | None = None) -> dict[str, tuple]:
    """The good requests, with the poisoned ones added between them when `poison` is given."""
    names = list(GOOD)
    for i, name in enumerate(names):
        prompt, sp = GOOD[name]
        eng.add_request(EngineRequest(name, prompt, sp))
        if poison and i == 1:  # after a seeded request: it draws before the bad seed raises
            _add_poisoned(eng, poison)
    outs: dict[str, list] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            outs.setdefault(out.request_id, []).append(out)
    return {
        rid: (
            [t for o in seq for t in o.new_token_ids],
            "".join(o.text_delta for o in seq),
            seq[-1].finish_reason,
            seq[-1].error,
        )
        for rid, seq in outs.items()
    }


def _add_poisoned(eng: LLMEngine, poison: dict[str, object]) -> None:
    sampling = SamplingParams(max_tokens=20, temperature=1.0, seed=3, ignore_eos=True)
    # A seed outside the 64-bit range, forced past validation: torch's manual_seed raises inside the step.
    eng.add_request(EngineRequest("bad-seed", [30, 31, 32], sampling))
    sampling.seed = 2**64
    # NaN logits: its prompt holds the token whose embedding row is NaN.
    eng.add_request(EngineRequest("nan", [30, poison["nan_token"], 32], SamplingParams(max_tokens=20)))
    # An exception while decoding its text, on its first token.
    eng.add_request(EngineRequest("bad-detok", [33, 34], SamplingParams(max_tokens=20, temperature=0.0)))
    eng.outputs.states["bad-detok"].detok = _ExplodingDetokenizer()


def test_poisoned_requests_fail_alone(tiny_llama, engine_factory) -> None:
    reference = _run(engine_factory(tiny_llama))
    assert set(reference) == set(GOOD) and all(r[3] is None and len(r[0]) == 20 for r in reference.values())
    used = {t for prompt, _ in GOOD.values() for t in prompt} | {t for r in reference.values() for t in r[0]}
    nan_token = next(t for t in range(100, 300) if t not in used)

    eng = engine_factory(tiny_llama)
    with torch.no_grad():
        eng.model.model.embed_tokens.weight[nan_token] = math.nan
    mixed = _run(eng, {"nan_token": nan_token})

    for name in GOOD:
        assert mixed[name] == reference[name], name
    for name in ("bad-seed", "nan", "bad-detok"):
        *_, reason, error = mixed[name]
        assert reason == FinishReason.ERROR and error, name
    assert "NaN" in mixed["nan"][3]
    # the engine goes on serving, every block is back (engine_factory checks integrity after the test)
    assert _run(eng) == reference


def _step_logits(eng: LLMEngine, sched) -> dict[str, torch.Tensor]:
    """Each sampling request's logits for `sched`, through the engine's model and backend (cache written)."""
    inp = build_inputs(sched.chunks, eng.config.block_size, eng.device)
    with torch.inference_mode():
        eng.runner.backend.begin(inp.attn)
        hidden = eng.model(inp.input_ids, inp.positions, eng.runner.backend)
        logits = eng.model.compute_logits(hidden[inp.sample_rows])
    return {c.request_id: logits[i].clone() for i, c in enumerate(inp.sample_chunks)}


def test_nan_in_one_sequences_kv_never_reaches_another(tiny_llama, engine_factory) -> None:
    """A long sequence's KV blocks (and every free block) are filled with NaN; a shorter decode in the same
    batch, whose block table is padded to the long one's width, and a prefill in the same step get exactly
    the logits of the unpoisoned step. The padding points at the null block, which no sequence owns."""
    eng = engine_factory(tiny_llama)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    eng.add_request(EngineRequest("long", list(range(10, 40)), greedy))
    eng.add_request(EngineRequest("short", [5, 6, 7], greedy))
    running = eng.scheduler.running
    while len(running) < 2 or any(r.num_computed_tokens < r.num_tokens - 1 for r in running):
        eng.step()
    eng.add_request(EngineRequest("fresh", [50, 51, 52, 53, 54], greedy))
    sched = eng.scheduler.schedule()
    prefills = {c.request_id: c.num_tokens > 1 for c in sched.chunks}
    assert prefills == {"long": False, "short": False, "fresh": True}
    clean = _step_logits(eng, sched)

    tables = {rid: t for rid, (t,) in eng.scheduler.kv.tables.items()}
    assert NULL_BLOCK not in {b for t in tables.values() for b in t}
    assert len(tables["short"]) < len(tables["long"])  # the short decode's table row is padded
    keep = set(tables["short"]) | set(tables["fresh"])
    poison = [b for b in range(1, eng.scheduler.kv.pool.num_blocks + 1) if b not in keep]
    storage = eng.runner.storage
    idx = torch.tensor(poison)
    for pool in (*storage.k, *storage.v):
        pool.data.index_fill_(0, idx, math.nan)
    poisoned = _step_logits(eng, sched)

    assert poisoned["long"].isnan().all()  # the poison is where the long sequence reads
    for rid in ("short", "fresh"):
        assert torch.equal(poisoned[rid], clean[rid]), rid
    for rid in ("long", "short", "fresh"):
        eng.abort(rid)
    storage.zero_blocks(poison)
