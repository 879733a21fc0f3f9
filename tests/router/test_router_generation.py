"""The router's light reading of a generation request (router/generation.py) gives what the node's full
validation gives: the same model, adapter and output-token reservation for every well-formed body, and no
answer at all (so the schemas judge it) where a field it reads is not plain."""

from __future__ import annotations

from typing import Any

import pytest

from edgeinfer.api.limits import NodeLimits
from edgeinfer.api.prepare import chat_job, completion_job, workers_ai_job
from edgeinfer.api.schemas import ChatCompletionRequest, CompletionRequest, WorkersAIRunRequest
from edgeinfer.router import generation

LIMITS = NodeLimits()
USER = [{"role": "user", "content": "hi"}]

COMPLETIONS = [
    {"model": "m", "prompt": "hi"},
    {"model": "m", "prompt": "hi", "max_tokens": 40, "n": 3},
    {"model": "m:adapter", "prompt": [1, 2, 3], "max_tokens": None},
    {"model": "m", "prompt": ["a", "b"], "n": 2, "max_tokens": 7},
    {"model": "m", "prompt": [[1, 2], [3]], "n": 1},
]
CHATS = [
    {"model": "m", "messages": USER},
    {"model": "m", "messages": USER, "max_tokens": 9, "n": 2},
    {"model": "m", "messages": USER, "max_completion_tokens": 5, "max_tokens": 9},
    {"model": "m", "messages": USER, "max_completion_tokens": None, "max_tokens": 11},
]
WORKERS_AI = [
    {"prompt": "hi"},
    {"prompt": "hi", "max_tokens": 30, "lora": "mine"},
    {"messages": USER, "lora": None},
]


@pytest.mark.parametrize("body", COMPLETIONS)
def test_completions_read_as_the_node_validates(body: dict[str, Any]) -> None:
    job = completion_job(CompletionRequest.model_validate(body), body, LIMITS)
    assert generation.completion(body, LIMITS) == generation.of_job(job, LIMITS)


@pytest.mark.parametrize("body", CHATS)
def test_chats_read_as_the_node_validates(body: dict[str, Any]) -> None:
    job = chat_job(ChatCompletionRequest.model_validate(body), body, LIMITS)
    assert generation.chat(body, LIMITS) == generation.of_job(job, LIMITS)


@pytest.mark.parametrize("body", WORKERS_AI)
def test_workers_ai_reads_as_the_node_validates(body: dict[str, Any]) -> None:
    job = workers_ai_job("m", WorkersAIRunRequest.model_validate(body), body, LIMITS)
    assert generation.workers_ai("m", body, LIMITS) == generation.of_job(job, LIMITS)


@pytest.mark.parametrize(
    "body",
    [
        [],
        {"prompt": "hi"},
        {"model": 3, "prompt": "hi"},
        {"model": "m", "prompt": "hi", "max_tokens": 0},
        {"model": "m", "prompt": "hi", "max_tokens": True},
        {"model": "m", "prompt": "hi", "max_tokens": 2.0},
        {"model": "m", "prompt": "hi", "n": "2"},
        {"model": "m", "prompt": []},
        {"model": "m", "prompt": [1, "a", {}]},
        {"model": "m"},
    ],
)
def test_what_is_not_plain_goes_to_the_schemas(body: Any) -> None:
    assert generation.completion(body, LIMITS) is None


def test_chat_and_workers_ai_fields_that_are_not_plain_go_to_the_schemas() -> None:
    assert generation.chat({"model": "m", "messages": USER, "max_completion_tokens": -1}, LIMITS) is None
    assert generation.chat({"model": None, "messages": USER}, LIMITS) is None
    assert generation.workers_ai("m", {"prompt": "hi", "lora": 3}, LIMITS) is None
    assert generation.workers_ai("m", {"prompt": "hi", "max_tokens": "9"}, LIMITS) is None
