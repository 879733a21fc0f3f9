"""The process's thread count (`start_runtime`, `--threads`): applied at start, every core by default."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from edgeinfer.engine.async_engine import STEP_THREAD_NAME, AsyncLLMEngine
from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.engine import LLMEngine
from edgeinfer.engine.runtime import runtime, start_runtime
from edgeinfer.engine.threads import available_cores, run_in_own_thread


@pytest.fixture
def restore_threads():
    before = runtime()
    yield
    start_runtime(before.threads, before.kernels)


def test_the_runtime_sets_the_thread_count_and_an_engines_step_thread_follows(tiny_llama, restore_threads):
    start_runtime(threads=1)
    engine = LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=16))
    assert torch.get_num_threads() == 1 and engine.runtime.threads == 1
    seen = []

    def step_thread() -> None:  # as the async engine's loop: a thread of its own running ops
        torch.ones(4).add_(1)
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=step_thread)
    t.start()
    t.join()
    assert seen == [1]


def test_the_default_is_every_available_core(restore_threads):
    torch.set_num_threads(1)
    assert start_runtime().threads == available_cores() == torch.get_num_threads()


def test_engines_leave_the_thread_count_as_the_runtime_has_it(tiny_llama, restore_threads):
    start_runtime(threads=1)
    LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=16))
    LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=16))  # a second model in the same process
    assert torch.get_num_threads() == 1


def test_zero_threads_is_refused():
    with pytest.raises(ValueError, match="threads"):
        start_runtime(threads=0)


def test_serve_refuses_zero_threads_in_one_line(tiny_llama, capsys):
    from edgeinfer.node.cli import main

    assert main(["--model", tiny_llama, "--threads", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "threads must be >= 1" in err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OS thread names are read from /proc")
def test_the_async_engines_step_thread_has_an_os_name(tiny_llama, restore_threads):
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=tiny_llama, dtype="float32", num_kv_blocks=16)))
    try:
        names = {p.read_text().strip() for p in Path(f"/proc/{os.getpid()}/task").glob("*/comm")}
        deadline = time.monotonic() + 10
        while STEP_THREAD_NAME not in names and time.monotonic() < deadline:
            time.sleep(0.01)
            names = {p.read_text().strip() for p in Path(f"/proc/{os.getpid()}/task").glob("*/comm")}
        assert STEP_THREAD_NAME in names
    finally:
        asyncio.run(engine.shutdown())


def test_one_off_work_runs_in_a_thread_that_ends_with_it():
    """The loader's thread must not outlive the load: its OpenMP team would stay beside the engine's."""
    seen: list[threading.Thread] = []

    def work() -> int:
        seen.append(threading.current_thread())
        return int(torch.ones(4).sum())  # a torch op, as a load runs

    def fail() -> None:
        raise ValueError("bad checkpoint")

    async def main() -> int:
        result = await run_in_own_thread(work)
        with pytest.raises(ValueError, match="bad checkpoint"):
            await run_in_own_thread(fail)
        return result

    assert asyncio.run(main()) == 4
    (thread,) = seen
    assert thread is not threading.main_thread()
    thread.join(timeout=5)
    assert not thread.is_alive()
