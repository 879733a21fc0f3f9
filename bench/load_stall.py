"""How long a running stream stalls while another model loads in the same process (as the pool loads one).

    python bench/load_stall.py

One engine decodes one greedy sequence in a thread (each step's end time recorded) while the main thread
loads a second copy of the default model phase by phase: open the checkpoint, read the tokenizer, load the
weights from the prepared-form cache, then load them afresh from the GGUF. For each phase: its duration and
the longest gap between two decode steps that overlaps it, against the longest gap in the 2 s before.
A stall comes from a phase that holds Python's GIL; the decode step itself releases it inside torch ops.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import shlex
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "src"), str(REPO / "bench")]  # run as a script without installing the package

import serve_report  # noqa: E402
from docs_table import replace_section  # noqa: E402
from startup import cpu_flags  # noqa: E402

from edgeinfer.engine.config import EngineConfig  # noqa: E402
from edgeinfer.engine.engine import LLMEngine  # noqa: E402
from edgeinfer.engine.loading import load_model  # noqa: E402
from edgeinfer.engine.model.loader import open_checkpoint  # noqa: E402
from edgeinfer.engine.tokenizer import Tokenizer  # noqa: E402
from edgeinfer.types import EngineRequest, SamplingParams  # noqa: E402

DOCS = REPO / "docs" / "benchmarks.md"


class Stream:
    """A greedy decode running in a thread; `stamps` are the end times of its steps."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        sampling = SamplingParams(max_tokens=1_000_000, temperature=0.0, ignore_eos=True)
        self.engine.add_request(EngineRequest("stream", [2, 818, 5279, 529], sampling))
        self.stamps: list[float] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop:
            self.engine.step()
            self.stamps.append(time.perf_counter())

    def __enter__(self) -> Stream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join()

    def longest_gap(self, start: float, end: float) -> float:
        """The longest gap between steps from `start` until the first step after `end`."""
        after = [t for t in self.stamps if t >= end][:1]
        points = [start, *(t for t in self.stamps if start < t < end), *after]
        return max(b - a for a, b in itertools.pairwise(points))


def phases(config: EngineConfig) -> list[tuple[str, Callable[[], object]]]:
    state: dict[str, object] = {}

    def opened() -> object:
        state["ckpt"] = open_checkpoint(config.model)
        return state["ckpt"]

    def weights(cache: bool) -> Callable[[], object]:
        return lambda: load_model(state["ckpt"], torch.bfloat16, torch.device("cpu"), _with(config, cache))

    return [
        ("open the checkpoint", opened),
        ("read the tokenizer", lambda: Tokenizer.from_checkpoint(state["ckpt"])),
        ("weights from the prepared-form cache", weights(True)),
        ("weights afresh from the GGUF (dequantized)", weights(False)),
    ]


def _with(config: EngineConfig, cache: bool) -> EngineConfig:
    return dataclasses.replace(config, prepared_cache=cache)


def main() -> int:
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as cache:
        config = EngineConfig(batch_window_ms=0, cache_dir=cache)
        with Stream(config) as stream:  # its load also fills the cache the second model reads
            time.sleep(3)
            baseline = stream.longest_gap(time.perf_counter() - 2, time.perf_counter())
            spans = []
            for name, run in phases(config):
                start = time.perf_counter()
                run()
                spans.append((name, start, time.perf_counter()))
                time.sleep(1)  # the stream steps past the phase's end before the next one starts
    rows = [(name, end - start, stream.longest_gap(start, end)) for name, start, end in spans]
    lines = [
        "### Stream stalls while a second model loads in the same process",
        "",
        f"Machine: {serve_report.machine_info()}; CPU flags: {cpu_flags()}; torch threads "
        f"{torch.get_num_threads()}. 1-min load average {load_before:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after (the machine is shared with other work).",
        f"Command: `python bench/load_stall.py {shlex.join(sys.argv[1:])}`. Gemma 3 270M bf16 decoding one "
        f"greedy sequence; longest gap between its steps in the 2 s before loading: {baseline * 1e3:.0f} ms.",
        "",
        "| phase of the second load | duration (s) | longest gap between decode steps (ms) |",
        "|---|---|---|",
        *(f"| {name} | {secs:.2f} | {gap * 1e3:.0f} |" for name, secs, gap in rows),
    ]
    body = "\n".join(lines)
    print(body)
    replace_section(DOCS, "load-stall", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
