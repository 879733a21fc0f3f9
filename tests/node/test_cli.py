"""`edgeinfer serve` arguments → node config and pool members."""

from __future__ import annotations

import argparse
import asyncio
import sys

import pytest

from edgeinfer.api.limits import NodeLimits
from edgeinfer.node.cli import add_arguments, build_config, build_specs


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_default_models_and_their_workers_ai_aliases() -> None:
    spec, embedding = build_specs(_parse())
    assert (spec.name, spec.kind, spec.target) == ("gemma-3-270m", "local", "gemma-3-270m")
    assert spec.aliases == ("@cf/google/gemma-3-270m",)
    assert (embedding.name, embedding.target) == ("all-minilm-l6-v2", "all-minilm-l6-v2")
    assert embedding.aliases == ("@cf/sentence-transformers/all-minilm-l6-v2",)


def test_models_upstreams_aliases_pins_and_limits() -> None:
    args = _parse(
        "--model",
        "@cf/meta/tiny=/models/tiny",
        "--upstream",
        "big=http://10.0.0.2:8000/v1",
        "--alias",
        "small=@cf/meta/tiny",
        "--pin",
        "@cf/meta/tiny",
        "--preload",
        "--max-n",
        "4",
        "--tenants",
        "keys.toml",
    )
    specs = {s.name: s for s in build_specs(args)}
    assert specs["@cf/meta/tiny"].pinned and specs["@cf/meta/tiny"].aliases == ("small",)
    assert specs["big"].kind == "upstream" and not specs["big"].pinned
    config = build_config(args)
    assert config.preload == ("@cf/meta/tiny",)  # bare --preload: every local model
    assert config.limits.max_n == 4 and config.tenants_file == "keys.toml"


def test_every_limit_has_a_flag() -> None:
    args = _parse()
    assert build_config(args).limits == NodeLimits()


def test_unknown_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown model"):
        build_specs(_parse("--model", "a=/x", "--pin", "b"))
    with pytest.raises(ValueError, match="limit max_n"):
        build_config(_parse("--max-n", "0"))


def test_the_switch_interval_is_the_servers_and_set_once_at_start(tiny_llama_dir: str) -> None:
    """Building an engine leaves the interpreter alone; the server's entry point sets its configured
    switch interval."""
    from edgeinfer.engine.async_engine import AsyncLLMEngine
    from edgeinfer.engine.config import EngineConfig
    from edgeinfer.node.http.server import configure_process

    assert build_config(_parse()).switch_interval_s == 0.0005
    config = build_config(_parse("--switch-interval-ms", "2"))
    assert config.switch_interval_s == 0.002
    before = sys.getswitchinterval()
    try:
        config_of_engine = EngineConfig(model=tiny_llama_dir, dtype="float32", num_kv_blocks=8)
        engine = AsyncLLMEngine.from_config(config_of_engine)
        assert sys.getswitchinterval() == before
        asyncio.run(engine.shutdown())
        configure_process(config)
        assert sys.getswitchinterval() == pytest.approx(0.002)
    finally:
        sys.setswitchinterval(before)
    with pytest.raises(ValueError, match="switch interval"):
        build_config(_parse("--switch-interval-ms", "0"))
