"""vLLM's `priority` request field: lower runs first under `--scheduling-policy priority`, within the range
the tenants file gives each key (0 for a key it gives none); outside it a 400 naming the field."""

from __future__ import annotations

import dataclasses
import threading
import time

import httpx
import pytest
from helpers.node_engine import TEST_ENGINE

from edgeinfer.api.keys import hash_key
from edgeinfer.api.tenants import TenantRegistry

KEYS = {"trusted": "trusted-key", "plain": "plain-key"}


def _post(url: str, key: str, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=120)


@pytest.fixture
def node(node_factory, make_tenant, tiny_llama_dir):
    tenants = [
        make_tenant("trusted", KEYS["trusted"], min_priority=-10, max_priority=10),
        make_tenant("plain", KEYS["plain"]),
    ]
    engine = dataclasses.replace(
        TEST_ENGINE, scheduling_policy="priority", max_num_seqs=1, kv_cache_memory_bytes=2**20
    )
    return node_factory({"tiny": tiny_llama_dir}, tenants=tenants, engine=engine)


def test_a_priority_outside_the_keys_range_is_a_400_naming_it(node) -> None:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    assert _post(node.url, KEYS["trusted"], {**body, "priority": -10}).status_code == 200
    for key, priority in ((KEYS["trusted"], 11), (KEYS["plain"], 1), (KEYS["plain"], -1)):
        answer = _post(node.url, key, {**body, "priority": priority})
        assert answer.status_code == 400
        error = answer.json()["error"]
        assert error["param"] == "priority" and "outside this key's range" in error["message"]
    assert _post(node.url, KEYS["plain"], {**body, "priority": 0}).status_code == 200


def test_the_more_important_request_runs_first(node) -> None:
    """One seat, held by a long request: of two that wait, the one with the lower priority value ends first
    though it came second."""
    body = {"model": "tiny", "prompt": "hi", "ignore_eos": True}
    ended: list[str] = []

    def send(name: str, priority: int, max_tokens: int) -> None:
        _post(node.url, KEYS["trusted"], {**body, "priority": priority, "max_tokens": max_tokens})
        ended.append(name)

    holder = threading.Thread(target=send, args=("holder", 0, 480))
    holder.start()
    time.sleep(0.3)  # the holder has the seat
    later = threading.Thread(target=send, args=("unimportant", 5, 4))
    later.start()
    time.sleep(0.2)
    first = threading.Thread(target=send, args=("important", -5, 4))
    first.start()
    for t in (holder, later, first):
        t.join()
    assert ended.index("important") < ended.index("unimportant")


@pytest.mark.parametrize(
    ("entry", "needle"),
    [
        ({"min_priority": 1}, "min_priority <= 0"),
        ({"max_priority": -1}, "min_priority <= 0"),
        ({"max_priority": True}, "integer"),
    ],
)
def test_a_bad_priority_range_in_the_tenants_file_is_refused(entry: dict, needle: str) -> None:
    data = {"tenants": [{"name": "a", "key_sha256": hash_key("k"), **entry}]}
    with pytest.raises(ValueError, match=needle):
        TenantRegistry.from_mapping(data, b"s" * 32)
