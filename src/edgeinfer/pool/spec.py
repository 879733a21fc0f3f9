"""What can be in the pool: local checkpoints and external OpenAI-compatible engines."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

LOCAL = "local"
UPSTREAM = "upstream"

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


@dataclass(frozen=True)
class MemberSpec:
    """One model the pool can serve under `name` (and its `aliases`).

    `target` is a checkpoint path or model name for local members and a base URL for upstream ones.
    A pinned member is never evicted; upstream members hold no local memory and are never evicted.
    `tokenizer` (upstreams): a checkpoint path or model name whose tokenizer counts the prompt tokens
    reserved against rate limits; without it they are estimated from the prompt's length.
    """

    name: str
    kind: str
    target: str
    aliases: tuple[str, ...] = field(default_factory=tuple)
    pinned: bool = False
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.strip():
            raise ValueError(f"model name {self.name!r} must be non-empty without surrounding spaces")
        if self.kind not in (LOCAL, UPSTREAM):
            raise ValueError(f"unknown pool member kind {self.kind!r} (local, upstream)")
        if self.kind == UPSTREAM and not self.target.startswith(("http://", "https://")):
            raise ValueError(f"upstream {self.name!r} needs an http(s) URL, got {self.target!r}")
        if self.tokenizer is not None and self.kind != UPSTREAM:
            raise ValueError(f"a tokenizer is given for upstream members only, not {self.name!r}")


def parse_model_arg(value: str) -> MemberSpec:
    """`NAME=PATH` (names may contain slashes) or a bare `PATH_OR_NAME` used as both."""
    name, sep, target = value.partition("=")
    if not sep:
        return MemberSpec(name=value, kind=LOCAL, target=value)
    if not name or not target:
        raise ValueError(f"--model expects NAME=PATH, got {value!r}")
    return MemberSpec(name=name, kind=LOCAL, target=target)


def parse_upstream_arg(value: str) -> MemberSpec:
    """`NAME=URL` of an OpenAI-compatible server (SGLang, vLLM, llama.cpp, another edgeinfer)."""
    name, sep, url = value.partition("=")
    if not sep or not name or not url:
        raise ValueError(f"--upstream expects NAME=URL, got {value!r}")
    return MemberSpec(name=name, kind=UPSTREAM, target=url)


def parse_upstream_tokenizer_arg(value: str) -> tuple[str, str]:
    """`NAME=PATH` → (upstream name, checkpoint path or model name of its tokenizer)."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--upstream-tokenizer expects NAME=PATH, got {value!r}")
    return name, path


def parse_alias_arg(value: str) -> tuple[str, str]:
    """`ALIAS=NAME` → (alias, name)."""
    alias, sep, name = value.partition("=")
    if not sep or not alias or not name:
        raise ValueError(f"--alias expects ALIAS=NAME, got {value!r}")
    return alias, name


def parse_bytes(value: str | int) -> int:
    """`2GiB`, `512MiB`, `1.5GB`, `1000000` → bytes (binary units are powers of 1024, decimal of 1000)."""
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"a memory size must be > 0, got {value}")
        return value
    match = _SIZE.match(value)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"cannot read memory size {value!r} (examples: 2GiB, 512MiB, 1.5GB, 1000000)")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"a memory size must be > 0, got {value!r}")
    return size


@dataclass(frozen=True)
class PublicPrefixes:
    """One model's shared prefixes (engine/public_prefix.py): completions-prompt texts and system prompts
    shared as their chat preamble."""

    texts: tuple[str, ...] = ()
    system_prompts: tuple[str, ...] = ()


def parse_public_prefixes(data: Mapping[str, Any]) -> dict[str, PublicPrefixes]:
    """`{MODEL: {"texts": [...], "system_prompts": [...]}}`; ValueError naming the bad entry."""
    out = {}
    for model, entry in data.items():
        if not isinstance(entry, dict) or set(entry) - {"texts", "system_prompts"}:
            raise ValueError(f"public prefixes for {model!r}: a table with `texts` and/or `system_prompts`")
        lists = {k: entry.get(k, []) for k in ("texts", "system_prompts")}
        for key, values in lists.items():
            if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
                raise ValueError(
                    f"public prefixes for {model!r}: `{key}` must be a list of non-empty strings"
                )
        out[model] = PublicPrefixes(tuple(lists["texts"]), tuple(lists["system_prompts"]))
    return out
