"""Speculative decoding by prompt lookup (scheduler/drafting.py, runner/speculative.py) changes how many
tokens a step emits, never which: greedy and seeded outputs equal those without it for every family,
batched and alone; unseeded sampling keeps its distribution; rejected drafts leave the KV blocks and the
prefix cache as if they had never been written; stops, max_tokens, grammars and logprobs come out as
without it."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from helpers.distribution import chi_square_critical, two_sample_chi_square
from helpers.tiny_models import MOE_FAMILIES

from edgeinfer.engine.kv_cache.hashing import iter_hashes
from edgeinfer.engine.kv_cache.manager import blocks_for
from edgeinfer.engine.scheduler.drafting import Drafter, NgramDrafter, SpecConfig
from edgeinfer.engine.scheduler.request import Request
from edgeinfer.types import EngineRequest, SamplingParams

SPEC = dict(
    speculative_method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=3, speculative_max_batch=64
)
# A passage given twice and a third copy begun (drafts from the prompt); a short prompt; and a trap for
# models that repeat their last token (some tiny random ones do, and accept every draft of a repeat): its
# end [50, 60] + [60] occurred before, followed by 70, which such a model does not write next.
COPY = list(range(40, 56)) * 2 + list(range(40, 46))
TRAP = [50, 60, 60, 70, 71, 72, 73, *range(100, 124), 50, 60]
PROMPTS = [COPY, [7, 8, 9], TRAP]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model(family: str, tiny_models: dict[str, str], moe_models: dict[str, str]) -> str:
    return moe_models[family] if family in moe_models else tiny_models[family]


def tokens(eng, prompts, sp=GREEDY) -> list[list[int]]:
    return [r.token_ids for r in eng.generate(prompts, sp)]


def drafted_and_accepted(eng) -> tuple[int, int]:
    s = eng.stats()
    return s.spec_drafted_by_source.get("ngram", 0), s.spec_accepted_by_source.get("ngram", 0)


@pytest.mark.parametrize(
    "family,dtype",
    [
        *[(f, "float32") for f in ("llama", "qwen3", "gemma3", *MOE_FAMILIES)],
        # bf16 on our kernels: the fused decode step verifies (dense GQA; MoE with latent attention)
        *[(f, "bfloat16") for f in ("llama", "gemma3", "deepseek_v3")],
    ],
)
def test_greedy_tokens_equal_without_speculation(family, dtype, tiny_models, moe_models, engine_factory):
    model = _model(family, tiny_models, moe_models)
    plain = engine_factory(model, dtype=dtype)
    spec = engine_factory(model, dtype=dtype, **SPEC)
    alone = [tokens(plain, [p])[0] for p in PROMPTS]
    assert [tokens(spec, [p])[0] for p in PROMPTS] == alone
    together = tokens(spec, PROMPTS)
    # fp32: batched = alone; bf16 prefills of other widths round otherwise, so against the same batch
    assert together == (alone if dtype == "float32" else tokens(plain, PROMPTS))
    drafted, accepted = drafted_and_accepted(spec)
    assert 0 < accepted < drafted  # drafts were accepted, and others rejected
    if dtype == "bfloat16":
        assert spec.runner.fused is not None  # the fused decode step took the verifying steps


def test_chunked_prefill_preemption_and_prefix_hits_with_speculation(tiny_models, engine_factory):
    """Chunked prompts, a pool so small that requests are preempted (recomputed) between speculative steps,
    and a second pass hitting the prefix cache: the tokens of each prompt alone without speculation."""
    alone = engine_factory(tiny_models["gemma3"], enable_prefix_caching=False)
    expected = [tokens(alone, [p])[0] for p in PROMPTS]
    tight = engine_factory(tiny_models["gemma3"], num_kv_blocks=24, max_num_batched_tokens=7, **SPEC)
    assert tokens(tight, PROMPTS) == expected
    assert tight.stats().num_preemptions > 0 and drafted_and_accepted(tight)[1] > 0
    cached = engine_factory(tiny_models["gemma3"], **SPEC)
    tokens(cached, PROMPTS)
    hits = cached.stats().prefix_cache_hits
    assert tokens(cached, PROMPTS) == expected and cached.stats().prefix_cache_hits > hits


def test_seeded_sampling_gives_the_same_tokens(tiny_models, engine_factory):
    """Each output position takes the same draw of the request's generator with or without speculation."""
    sp = [SamplingParams(max_tokens=24, temperature=0.02, seed=i, ignore_eos=True) for i in range(12)]
    prompts = [COPY] * 12
    plain = engine_factory(tiny_models["llama"])
    spec = engine_factory(tiny_models["llama"], **SPEC)
    assert tokens(spec, prompts, sp) == tokens(plain, prompts, sp)
    drafted, accepted = drafted_and_accepted(spec)
    assert 0 < accepted < drafted


# every decode drafts: no step-time budget, room for all 256 requests' drafts in one step
WIDE = dict(max_num_seqs=256, num_kv_blocks=3000, max_step_ms=None, max_num_batched_tokens=4096)


def assert_sampled_alike(plain, spec, rounds: int) -> None:
    """`rounds` x 256 samples of the first 5 tokens after a copy-heavy prompt, from an engine without
    speculation and one with it: per position and jointly, the same distribution."""
    prompt = COPY + tokens(plain, [COPY], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    sp = SamplingParams(max_tokens=5, temperature=0.02, ignore_eos=True)
    torch.manual_seed(0)
    samples: dict[str, list[tuple[int, ...]]] = {"plain": [], "spec": []}
    for _ in range(rounds):
        for name, eng in (("plain", plain), ("spec", spec)):
            samples[name] += [tuple(t) for t in tokens(eng, [prompt] * 256, sp)]
    for cut in (*(slice(i, i + 1) for i in range(5)), slice(0, 3)):
        a = Counter(s[cut] for s in samples["plain"])
        b = Counter(s[cut] for s in samples["spec"])
        stat, dof = two_sample_chi_square(a, b)
        assert dof >= 2 and stat < chi_square_critical(dof), (
            cut,
            stat,
            dof,
            a.most_common(4),
            b.most_common(4),
        )


def test_unseeded_sampling_keeps_its_distribution(tiny_models, engine_factory):
    """Many samples of the first tokens after a copy-heavy prompt, with and without speculation: per position
    and jointly, the same distribution (a rule that kept a mismatched draft 3 times in 10 fails here)."""
    plain = engine_factory(tiny_models["llama"], **WIDE)
    spec = engine_factory(tiny_models["llama"], **WIDE, **{**SPEC, "speculative_max_batch": 256})
    assert_sampled_alike(plain, spec, rounds=8)
    drafted, accepted = drafted_and_accepted(spec)
    assert accepted > 0.15 * drafted > 100  # both paths carry much of the output


def test_rejected_drafts_leave_blocks_and_prefix_cache_intact(tiny_models, engine_factory):
    """After every step: each request holds exactly the blocks its tokens need, the prefix index holds only
    blocks of verified tokens (their hashes are those of the request's real tokens) and the pool's books
    balance. Afterwards, prefix-cache hits on what was generated give the uncached answer."""
    eng = engine_factory(tiny_models["gemma3"], **SPEC)
    kv = eng.scheduler.kv
    for i, p in enumerate(PROMPTS):
        eng.add_request(EngineRequest(f"r{i}", p, GREEDY))
    while eng.has_unfinished_requests():
        eng.step()
        eng.check_integrity()
        for req in eng.scheduler.running:
            table = kv.tables[req.request_id][0]  # every group's table has one entry per block
            # what its computed tokens fill, and at most the next token's slot: none kept for rejected drafts
            bs = kv.block_size
            assert blocks_for(req.num_computed_tokens, bs) <= len(table) <= blocks_for(req.num_tokens, bs)
            chain = kv._chains[req.request_id]
            full = req.num_computed_tokens // kv.block_size * kv.block_size
            assert chain.hashes == list(
                iter_hashes(req.cache_namespace, req.all_token_ids[:full], kv.block_size)
            )
            assert req.num_computed_tokens == req.num_tokens - 1
    drafted, accepted = drafted_and_accepted(eng)
    assert accepted < drafted
    assert kv.pool.num_free == kv.pool.num_blocks  # everything back (cached blocks count as free)
    generated = tokens(eng, PROMPTS)
    hits_before = eng.stats().prefix_cache_hits
    again = [p + g[:20] for p, g in zip(PROMPTS, generated, strict=True)]
    uncached = engine_factory(tiny_models["gemma3"], enable_prefix_caching=False)
    assert tokens(eng, again) == [tokens(uncached, [p])[0] for p in again]
    assert eng.stats().prefix_cache_hits > hits_before


class OracleDrafter(Drafter):
    """Drafts what the model will write (known from a run without speculation): every draft is accepted, so
    each step emits a run of 1 + num_speculative_tokens tokens that a stop can cut in the middle."""

    source = "ngram"

    def __init__(self, continuation: list[int]) -> None:
        super().__init__(SpecConfig(num_tokens=4))
        self.continuation = continuation

    def propose(self, req: Request, limit: int) -> list[int]:
        at = len(req.output_token_ids)
        return self.continuation[at : at + limit]


def test_stops_and_max_tokens_cut_accepted_runs(tiny_models, engine_factory):
    """A stop token, a stop string or max_tokens that falls inside a run of accepted drafts ends the output
    there, as without speculation; logprobs come with exactly the emitted tokens."""
    plain = engine_factory(tiny_models["llama"])
    spec = engine_factory(tiny_models["llama"], **SPEC)
    (full,) = plain.generate([COPY], GREEDY)
    spec.scheduler.drafter = OracleDrafter(full.token_ids)
    ids, tok = full.token_ids, plain.tokenizer
    # the first token after the prefill's comes in runs of 5 (1..5, 6..10, ...): a cut not at a run's end,
    # at a token's first occurrence, whose text first occurs there too
    cut = next(
        i
        for i in range(2, len(ids) - 1)
        if i % 5
        and ids.index(ids[i]) == i
        and full.text.find(tok.decode(ids[i : i + 1])) == len(tok.decode(ids[:i]))
    )
    cases = [
        SamplingParams(max_tokens=cut + 1, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, stop_token_ids=[ids[cut]]),
        SamplingParams(
            max_tokens=32, temperature=0.0, ignore_eos=True, stop=[tok.decode(ids[cut : cut + 1])]
        ),
        SamplingParams(
            max_tokens=32, temperature=0.0, ignore_eos=True, stop=[tok.decode(ids[cut : cut + 1])], logprobs=2
        ),
    ]
    for sp in cases:
        (a,) = plain.generate([COPY], sp)
        drafted = drafted_and_accepted(spec)[0]
        (b,) = spec.generate([COPY], sp)
        assert len(b.token_ids) == cut + 1 and len(b.outputs) < len(b.token_ids)  # runs came
        if sp.max_tokens == 32:  # the stop cut accepted drafts (max_tokens: none drafted past it)
            assert drafted_and_accepted(spec)[0] - drafted > cut
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason), sp
        # the same logprobs (fp32: a row's attention sums in another order among more rows, hence approx)
        got = [
            [(lp.token_id, [t for t, _ in lp.top]) for o in r.outputs for lp in o.logprobs] for r in (a, b)
        ]
        values = [[lp.logprob for o in r.outputs for lp in o.logprobs] for r in (a, b)]
        assert got[0] == got[1] and values[0] == pytest.approx(values[1], abs=1e-4)
        assert len(got[1]) == (len(b.token_ids) if sp.logprobs is not None else 0)


def test_grammar_masks_each_drafted_row(json_llama_dir, engine_factory):
    """A JSON schema over a random model (only the grammar's masks make its answers JSON): drafts of what it
    will write, with one token the grammar forbids at that point put in. Each row's mask must be the
    grammar's state after the drafts before it (a mask of the wrong state changes the random model's
    pick), and the forbidden draft is rejected: the answers equal those without speculation."""
    from edgeinfer.structured.grammar import json_schema_grammar

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "minLength": 12}, "tags": {"type": "array", "minItems": 2}},
        "required": ["name", "tags"],
    }
    grammar = json_schema_grammar(schema)
    plain = engine_factory(json_llama_dir)
    spec = engine_factory(json_llama_dir, **SPEC)
    prompt = plain.tokenizer.encode("Answer in JSON: ")
    pad = plain.tokenizer.encode("<pad>", add_special_tokens=False)
    for sp in (
        SamplingParams(max_tokens=40, temperature=0.0, grammar=grammar),
        SamplingParams(max_tokens=40, temperature=0.8, seed=5, grammar=grammar),
    ):
        (a,) = plain.generate([prompt], sp)
        assert len(a.token_ids) > 20
        poisoned = [*a.token_ids[:13], *pad, *a.token_ids[14:]]  # a special token, never JSON
        spec.scheduler.drafter = OracleDrafter(poisoned)
        before = drafted_and_accepted(spec)
        (b,) = spec.generate([prompt], sp)
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
        drafted, accepted = (x - y for x, y in zip(drafted_and_accepted(spec), before, strict=True))
        assert 0.5 * drafted < accepted < drafted


@pytest.fixture(scope="module")
def json_llama_dir(tmp_path_factory) -> str:
    from helpers.structured_models import make_structured_tiny

    return str(make_structured_tiny("llama", tmp_path_factory.mktemp("spec-json") / "llama"))


def test_turned_down_in_big_batches_and_per_request(tiny_models, engine_factory):
    eng = engine_factory(tiny_models["llama"], **{**SPEC, "speculative_max_batch": 2})
    tokens(eng, [COPY] * 3)  # three decode together: more than 2, no drafts
    assert drafted_and_accepted(eng) == (0, 0)
    tokens(eng, [COPY], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, speculative=False))
    assert drafted_and_accepted(eng) == (0, 0)
    tokens(eng, [COPY] * 2)
    assert drafted_and_accepted(eng)[0] > 0


def test_metrics_show_drafted_accepted_and_rate_per_source(tiny_models, engine_factory):
    """Engine stats → pool member stats → the node's /metrics series."""
    from edgeinfer.obs.metrics import EngineGauges, NodeMetrics
    from edgeinfer.pool.member import LocalMember

    eng = engine_factory(tiny_models["gemma3"], **SPEC)
    tokens(eng, PROMPTS)
    drafted, accepted = drafted_and_accepted(eng)
    assert 0 < accepted < drafted
    stats = LocalMember("tiny", eng, "v1", 4).stats()  # reads only engine.stats()
    gauges = EngineGauges(
        num_running=0,
        num_waiting=0,
        spec_drafted_by_source=stats.spec_drafted_by_source,
        spec_accepted_by_source=stats.spec_accepted_by_source,
    )
    text = NodeMetrics(engine_source=lambda: {"tiny": gauges}).render().decode()
    labels = '{model="tiny",source="ngram"}'
    assert f"edgeinfer:spec_decode_num_draft_tokens_total{labels} {float(drafted)}" in text
    assert f"edgeinfer:spec_decode_num_accepted_tokens_total{labels} {float(accepted)}" in text
    assert f"edgeinfer:spec_decode_acceptance_rate{labels} {accepted / drafted}" in text


def test_ngram_lookup_proposes_what_followed_the_latest_match():
    drafter = NgramDrafter(SpecConfig(ngram_min=1, ngram_max=3))
    req = Request("r", [1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3], SamplingParams())
    assert drafter.propose(req, 3) == [4, 5, 1]  # the latest earlier [1, 2, 3], not the first
    req.output_token_ids += [7]
    assert drafter.propose(req, 3) == []  # [.., 3, 7] and [7] never occurred before
    req.output_token_ids += [1, 2]
    assert drafter.propose(req, 2) == [3, 7]  # [7, 1, 2] did not occur; [1, 2] last at 9..10
    # a repeating pattern is drafted on past the end of the context, one period after another
    assert drafter.propose(Request("p", [5, 6, 5, 6], SamplingParams()), 5) == [5, 6, 5, 6, 5]
    # a match across token boundaries is not one: 256 then 0 hold the bytes of 1 one byte off
    odd = Request("o", [1, 7, 256, 0, 5, 1], SamplingParams())
    assert drafter.propose(odd, 2) == [7, 256]
    drafter.forget("r")
    assert "r" not in drafter._buffers


def test_draft_length_follows_acceptance():
    drafter = NgramDrafter(SpecConfig(num_tokens=8))
    assert drafter.length("r") == 8
    drafter.observe("r", 8, 2)  # rejected at the third: ask for one more than was accepted
    assert drafter.length("r") == 3
    drafter.observe("r", 3, 3)  # accepted whole: double, up to num_tokens
    assert drafter.length("r") == 6
    drafter.observe("r", 6, 6)
    assert drafter.length("r") == 8
    drafter.observe("r", 8, 0)
    assert drafter.length("r") == 1
    drafter.forget("r")
    assert drafter.length("r") == 8


PASSAGE = (
    "Paged attention stores the keys and values of every sequence in fixed-size blocks, so that memory is "
    "allocated as a sequence grows and freed blocks are reused at once by other requests."
)


@pytest.mark.gemma
def test_default_model_greedy_equal_and_copies_in_runs(default_gguf, engine_factory):
    """Gemma 3 270M in bf16 (the fused decode step) on a passage given twice with a third copy begun: the
    same tokens as without speculation (the request's opt-out), most of them from accepted drafts; a stop
    string inside the copied run ends the output where it does without speculation."""
    kw = dict(dtype="bfloat16", num_kv_blocks=64, block_size=16, max_num_batched_tokens=1024)
    eng = engine_factory(str(default_gguf), **kw, **{**SPEC, "num_speculative_tokens": 6})
    prompt = eng.tokenizer.encode(f"Repeat the text.\n{PASSAGE}\n{PASSAGE}\n{PASSAGE[:40]}")
    for stop in ([], ["freed"]):
        sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=stop)
        (a,) = eng.generate([prompt], dataclasses.replace(sp, speculative=False))
        assert drafted_and_accepted(eng) == (0, 0) or stop
        (b,) = eng.generate([prompt], sp)
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
        assert len(b.outputs) < len(b.token_ids) / 2  # mostly accepted runs
    assert b.text.endswith("sequence grows and ") and PASSAGE[40:80] in a.text
    assert drafted_and_accepted(eng)[1] > 30
