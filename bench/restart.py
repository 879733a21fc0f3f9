"""Restarts: a cached start of `edgeinfer serve` on its own and with `edgeinfer standby` running, against
llama.cpp's llama-server, on the default model (Gemma 3 270M) and the MoE benchmark models
(bench/moe_vs_llamacpp.py builds them).

    python bench/restart.py                                # gemma, glm45 and deepseek; bf16 and int4
    python bench/restart.py --models glm45 --precision bf16 --repeats 3 --no-docs

Gemma is served as bench/startup.py serves it (`--preload gemma-3-270m` from its Q4_K_M GGUF; llama-server
on the GGUF of the same class); the MoE models from their HF directories as bench/moe_vs_llamacpp.py does.
Per model and precision: one untimed start of each server (llama-server's GGUF into the page cache; ours
filling its prepared-form cache, bench/.peers/moe/edgeinfer-cache/NAME-PRECISION, where it is kept, if it
is not there yet: the first start is the other scripts' to time); then a standby is started with
the same environment, and `--repeats` rounds take turns: llama-server, `edgeinfer serve` with
EDGEINFER_STANDBY=off, and `edgeinfer serve` handed to the standby, each timed from the process's spawn to
ready (`/ready`, `/health`) and to an answered 8-token request, then stopped. Medians per server. Peak RSS
is VmHWM of the process that serves (with a standby, its forked child) after that request. Results:
bench/results/restart-CPU.json, and the section restart-CPU of docs/benchmarks.md unless `--no-docs`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "src"), str(REPO / "bench")]  # run as a script without installing the package

import moe_vs_llamacpp as moe  # noqa: E402
import peers  # noqa: E402
import serve_report  # noqa: E402
from docs_table import replace_section  # noqa: E402

from edgeinfer.engine.model.loader.default_model import DEFAULT_MODEL, resolve_default_model  # noqa: E402

DOCS = REPO / "docs" / "benchmarks.md"
RESULTS = REPO / "bench" / "results"
CPU = peers.cpu_family()
STORE = RESULTS / f"restart-{CPU}.json"
SERVERS = ("llama.cpp", "edgeinfer", "edgeinfer + standby")
GEMMA = "gemma"


def timed(
    argv: list[str], port: int, health: str, env: dict[str, str], log: Path, server_pid: Callable[[int], int],
    timeout_s: float = 600,
) -> dict[str, float]:  # fmt: skip
    """bench/moe_vs_llamacpp.py's timed start (to `health`, then to an answered 8-token completion), with
    VmHWM read of the process `server_pid(spawned pid)` names: with a standby, the forked child serves."""
    with moe.timed_server(argv, port, health, log, timeout_s, env, poll_s=0.01) as (server, start):
        rss = moe.peak_rss_mib(server_pid(server.process.pid))
    return {"ready_s": start.ready_s, "answered_s": start.answered_s, "peak_rss_mib": rss}


@contextlib.contextmanager
def standby(env: dict[str, str], log: Path) -> Iterator[Callable[[int], int]]:
    """`edgeinfer standby` with `env`; yields how to find the server a client's start became (the
    standby's one child)."""
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "edgeinfer.cli", "standby"], env=env, stderr=out)
    try:
        deadline = time.monotonic() + 600
        while "ready on" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"standby did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        yield lambda _client: int(children.read_text().split()[0])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def commands(name: str, precision: str, args: argparse.Namespace) -> tuple[list[str], list[str], Path]:
    """llama-server's command line, ours and our cache directory, for `name` at `precision`."""
    cache = moe.WORK / "edgeinfer-cache" / f"{name}-{precision}"
    if name == GEMMA:
        gguf = peers.peer_gguf(precision, resolve_default_model())
        ours = [sys.executable, "-m", "edgeinfer.cli", "serve", "--preload", DEFAULT_MODEL, "--host",
                "127.0.0.1", "--port", str(args.port + 1), "--no-access-log", "--usage-db",
                str(RESULTS / "usage.sqlite"), "--cache-dir", str(cache)]  # fmt: skip
        ours += moe.OUR_ARGS[precision]
    else:
        art = moe.prepare(name, [precision])
        gguf = art.ggufs[precision]
        ours = moe.our_argv(name, art.hf_dir, precision, args.port + 1, None, cache)
    return moe.peer_argv(gguf, args.port, 1, args.ctx, None), ours, cache


def measure(name: str, precision: str, args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    logs = RESULTS / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    peer, ours, cache = commands(name, precision, args)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
           "EDGEINFER_STANDBY": str(cache / "standby.sock")}  # fmt: skip
    alone = {**env, "EDGEINFER_STANDBY": "off"}
    log = logs / f"restart-{name}-{precision}.log"
    same: Callable[[int], int] = lambda pid: pid  # noqa: E731
    timed(peer, args.port, "/health", alone, log, same)
    timed(ours, args.port + 1, "/ready", alone, log, same, args.start_timeout)  # may prepare the model
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in SERVERS}
    with standby(env, logs / f"restart-standby-{name}-{precision}.log") as child:
        for _ in range(args.repeats):
            runs["llama.cpp"].append(timed(peer, args.port, "/health", alone, log, same))
            runs["edgeinfer"].append(timed(ours, args.port + 1, "/ready", alone, log, same))
            runs["edgeinfer + standby"].append(timed(ours, args.port + 1, "/ready", env, log, child))
    for server, starts in runs.items():
        print(f"{name} {precision} {server}: " + ", ".join(f"{s['ready_s']:.2f}/{s['answered_s']:.2f}"
                                                          for s in starts), file=sys.stderr)  # fmt: skip
    return {
        "median": {s: {k: statistics.median(r[k] for r in runs[s]) for k in runs[s][0]} for s in SERVERS},
        "repeats": args.repeats,
        "load": [load_before, os.getloadavg()[0]],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": f"python bench/restart.py {' '.join(sys.argv[1:])}".rstrip(),
    }


def table(stored: dict[str, Any]) -> str:
    rows = [
        "| model | class | llama-server: ready / answered s | edgeinfer: ready / answered s | ratio | "
        "edgeinfer, standby running: ready / answered s | ratio | VmHWM MiB: llama-server / edgeinfer / "
        "with standby | load avg | measured |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = [GEMMA, *moe.MODELS]
    for key, entry in sorted(stored.items(), key=lambda kv: (order.index(kv[0].split("/")[0]), kv[0])):
        name, precision = key.split("/")
        m = entry["median"]
        peer = m["llama.cpp"]

        def cell(server: str, m: dict = m, peer: dict = peer) -> str:
            s = m[server]
            ratio = f"{s['ready_s'] / peer['ready_s']:.2f}× / {s['answered_s'] / peer['answered_s']:.2f}×"
            return f"{s['ready_s']:.2f} / {s['answered_s']:.2f} | {ratio}"

        rss = " / ".join(f"{m[s]['peak_rss_mib']:.0f}" for s in SERVERS)
        rows.append(
            f"| {name} | {precision} | {peer['ready_s']:.2f} / {peer['answered_s']:.2f} | "
            f"{cell('edgeinfer')} | {cell('edgeinfer + standby')} | {rss} | "
            f"{entry['load'][0]:.1f} → {entry['load'][1]:.1f} | {entry['date']} |"
        )
    return "\n".join(rows)


def describe(stored: dict[str, Any]) -> str:
    commands = sorted({e["command"] for e in stored.values()})
    repeats = sorted({e["repeats"] for e in stored.values()})
    return "\n".join([
        f"### Restarts: edgeinfer with and without a standby vs llama-server, {CPU} CPU",
        "",
        f"Machine: {serve_report.machine_info()}; each server's default thread count; one server at a time.",
        "Models: `gemma`, the default model (ours `--preload gemma-3-270m` from its Q4_K_M GGUF, "
        "llama-server on the GGUF of the same class, as in the cold-start table), and "
        "bench/moe_vs_llamacpp.py's GLM-4.5- and DeepSeek-V3-shaped checkpoints (~0.7B parameters, random "
        "weights; llama-server on their BF16 and Q4_K_M GGUFs, ours on the HF directory); llama-server with "
        "`-np 1`, ours with "
        "`--quantization int4` for int4, its prepared form cached. Each row: an untimed start of each "
        f"server, then {', '.join(map(str, repeats))} rounds taking turns: "
        "llama-server, `edgeinfer serve` on its own (EDGEINFER_STANDBY=off), and `edgeinfer serve` with "
        "`edgeinfer standby` running (started once, same environment); medians. Times run from the spawn of "
        "the command to `/ready` (`/health`) answering and to an answered 8-token completion; ratios are "
        "edgeinfer / llama-server (below 1 is faster). VmHWM is the serving process's peak RSS (with a "
        "standby, the forked child's, which counts the imports it shares with the standby).",
        "Commands: " + "; ".join(f"`{c}`" for c in commands),
        "",
        table(stored),
    ])  # fmt: skip


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = [GEMMA, *moe.MODELS]
    p.add_argument("--models", nargs="+", choices=names, default=names)
    p.add_argument("--precision", nargs="+", choices=list(moe.OUR_ARGS), default=list(moe.OUR_ARGS))
    p.add_argument("--repeats", type=int, default=5, help="rounds of starts, taking turns")
    p.add_argument("--ctx", type=int, default=2048, help="llama-server KV tokens")
    p.add_argument("--port", type=int, default=8350, help="llama-server port; ours uses port + 1")
    p.add_argument(
        "--start-timeout", type=float, default=3600, help="seconds for the untimed start (it may prepare)"
    )
    p.add_argument("--no-docs", dest="write_docs", action="store_false")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the servers and the standby
    peers.build()
    stored = json.loads(STORE.read_text()) if STORE.exists() else {}
    for name in args.models:
        for precision in args.precision:
            stored[f"{name}/{precision}"] = measure(name, precision, args)
            STORE.parent.mkdir(parents=True, exist_ok=True)
            STORE.write_text(json.dumps(stored, indent=1))
            body = describe(stored)
            print(body)
            if args.write_docs:
                replace_section(DOCS, f"restart-{CPU}", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
