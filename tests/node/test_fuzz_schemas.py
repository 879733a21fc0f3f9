"""Property-based fuzzing of the request schemas against a live node: whatever the body holds, the answer is
never a 5xx, the server stays up, and no KV block is left behind."""

from __future__ import annotations

import json
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

WAI = "/accounts/acct/ai/run/"

_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.text(max_size=12),
    st.just("a\ud800"),  # a lone surrogate, valid in JSON text
)
_JUNK = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
# max_tokens is always there and small when it is a number, so valid examples generate only a few tokens.
_MAX_TOKENS = st.one_of(
    st.integers(min_value=-2, max_value=6),
    _SCALARS.filter(lambda v: not isinstance(v, int) or isinstance(v, bool)),
)
_SMALL = st.one_of(st.integers(min_value=-3, max_value=12), _SCALARS)
_FRACTION = st.one_of(st.floats(min_value=-1, max_value=12, allow_nan=False), _SCALARS)
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "x"])},
    optional={
        "content": st.one_of(
            st.text(max_size=12),
            st.just("a\udfff"),
            st.lists(
                st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": _SCALARS}),
                max_size=2,
            ),
            _SCALARS,
        )
    },
)
_MESSAGES = st.one_of(st.lists(_MESSAGE, max_size=3), _JUNK)
_PROMPT = st.one_of(
    st.text(max_size=16),
    st.lists(st.integers(min_value=-5, max_value=600), max_size=6),
    st.lists(st.text(max_size=6), max_size=3),
    _JUNK,
)
_SAMPLING = {
    "temperature": _FRACTION,
    "top_p": _FRACTION,
    "top_k": st.one_of(_SMALL, st.integers(min_value=-(2**65), max_value=2**65)),
    "min_p": _FRACTION,
    "n": _SMALL,
    "best_of": _SMALL,
    "seed": st.one_of(st.integers(min_value=-(2**65), max_value=2**65), _SCALARS),
    "stop": st.one_of(st.lists(st.text(max_size=3), max_size=3), _SCALARS),
    "stop_token_ids": st.one_of(st.lists(st.integers(min_value=-3, max_value=2**64), max_size=3), _SCALARS),
    "presence_penalty": _FRACTION,
    "frequency_penalty": _FRACTION,
    "repetition_penalty": _FRACTION,
    "min_tokens": _SMALL,
    "ignore_eos": _SCALARS,
    "stream": st.booleans(),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), _SCALARS),
    "logit_bias": _JUNK,
    "response_format": st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}), _SCALARS
    ),
    "tools": _JUNK,
    "options": st.one_of(st.fixed_dictionaries({"rejectIfBusy": _SCALARS}), _SCALARS),
}
_MODEL = st.sampled_from(["tiny", "@cf/test/tiny", "nope", ""])


# Valid bodies (each field in range), so that fuzzed requests also reach the engine and run there.
_VALID_SAMPLING = {
    "temperature": st.floats(min_value=0, max_value=2),
    "top_p": st.floats(min_value=0.05, max_value=1),
    "top_k": st.integers(min_value=-1, max_value=2**31 - 1),
    "min_p": st.floats(min_value=0, max_value=1),
    "n": st.integers(min_value=1, max_value=3),
    "seed": st.integers(min_value=0, max_value=2**64 - 1),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
    "presence_penalty": st.floats(min_value=-2, max_value=2),
    "frequency_penalty": st.floats(min_value=-2, max_value=2),
    "repetition_penalty": st.floats(min_value=0.5, max_value=2),
    "min_tokens": st.integers(min_value=0, max_value=2),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
}
_VALID_TEXT = st.text(min_size=1, max_size=16)
_VALID_MESSAGES = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]), "content": _VALID_TEXT}),
    min_size=1,
    max_size=2,
).map(lambda ms: [*ms, {"role": "user", "content": "hi"}])
_FEW_TOKENS = st.integers(min_value=1, max_value=6)


def _valid_bodies() -> st.SearchStrategy[tuple[str, dict[str, Any]]]:
    completion = st.fixed_dictionaries(
        {
            "model": st.just("tiny"),
            "prompt": st.one_of(_VALID_TEXT, st.lists(st.integers(3, 300), min_size=1, max_size=6)),
            "max_tokens": _FEW_TOKENS,
        },
        optional={**_VALID_SAMPLING, "echo": st.booleans(), "logprobs": st.integers(0, 5)},
    )
    chat = st.fixed_dictionaries(
        {"model": st.just("tiny"), "messages": _VALID_MESSAGES, "max_tokens": _FEW_TOKENS},
        optional={**_VALID_SAMPLING, "logprobs": st.just(True), "top_logprobs": st.integers(0, 5)},
    )
    workers_ai = st.fixed_dictionaries(
        {"prompt": _VALID_TEXT, "max_tokens": _FEW_TOKENS},
        optional={k: v for k, v in _VALID_SAMPLING.items() if k not in ("n", "min_p", "stop", "min_tokens")},
    )
    return st.one_of(
        st.tuples(st.just("/v1/completions"), completion),
        st.tuples(st.just("/v1/chat/completions"), chat),
        st.tuples(st.just(WAI + "tiny"), workers_ai),
    )


def _one_field_off(case: tuple[str, dict[str, Any]], key: str, value: Any) -> tuple[str, dict[str, Any]]:
    return case[0], {**case[1], key: value}


def _bodies() -> st.SearchStrategy[tuple[str, Any]]:
    """Valid bodies, valid bodies with one field replaced by junk, and bodies of junk."""
    completion = st.fixed_dictionaries(
        {"model": _MODEL, "prompt": _PROMPT, "max_tokens": _MAX_TOKENS},
        optional={**_SAMPLING, "echo": _SCALARS, "logprobs": _SMALL, "suffix": _SCALARS},
    )
    chat = st.fixed_dictionaries(
        {"model": _MODEL, "messages": _MESSAGES, "max_tokens": _MAX_TOKENS},
        optional={
            **_SAMPLING,
            "logprobs": _SCALARS,
            "top_logprobs": _SMALL,
            "max_completion_tokens": _MAX_TOKENS,
        },
    )
    workers_ai = st.fixed_dictionaries(
        {"max_tokens": _MAX_TOKENS},
        optional={**_SAMPLING, "prompt": _PROMPT, "messages": _MESSAGES, "raw": _SCALARS},
    )
    keys = st.sampled_from([*_SAMPLING, "prompt", "messages", "model", "echo", "logprobs", "top_logprobs"])
    return st.one_of(
        _valid_bodies(),
        st.builds(_one_field_off, _valid_bodies(), keys, st.one_of(_JUNK, _SMALL, _FRACTION)),
        st.tuples(st.just("/v1/completions"), completion),
        st.tuples(st.just("/v1/chat/completions"), chat),
        st.tuples(_MODEL.map(lambda m: WAI + (m or "tiny")), workers_ai),
        st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions", WAI + "tiny"]), _JUNK),
    )


@settings(
    max_examples=150,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=_bodies())
def _check_no_server_error(client: httpx.Client, case: tuple[str, Any]) -> None:
    path, body = case
    r = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code < 500, (path, body, r.text)
    if r.status_code >= 400:
        answer = r.json()
        assert "errors" in answer if path.startswith("/accounts/") else "error" in answer


def test_fuzzed_bodies_get_no_5xx_and_leak_nothing(shared_node) -> None:
    with httpx.Client(base_url=shared_node.url, timeout=60) as client:
        _check_no_server_error(client)
        assert client.get("/health").status_code == 200
    shared_node.wait_idle("tiny")
    shared_node.engine("tiny").check_integrity()
    assert shared_node.engine("tiny").stats().kv_usage == 0.0
