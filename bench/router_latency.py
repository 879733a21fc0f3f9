"""Router added latency: TTFT through `edgeinfer router` and through `sglang-router` (each pinned to CPU 0)
minus TTFT straight to the same stub node, at 1, 64 and 256 concurrent streams; and the most requests/s each
router passes on its one core.

    python bench/router_latency.py [--write docs/benchmarks.md] [--scale 1.0] [--streams 256] [--quick]
                                   [--no-rate]

`--streams` (these levels only), `--quick` (no sglang-router) and `--no-rate` (no requests/s run) are for
iterating.

The load side must cost less than the routers, or the numbers describe it instead: the stub node
(bench/router_stub.py) and the load generator run in this one process, on one uvloop event loop pinned to
CPU 1, both on raw asyncio protocols (a hand-written HTTP/1.1 request, keep-alive, an incremental chunked
reader) with no HTTP library. Each row reports the CPU the router process and this process used over its
window, and how busy each core was, so that a row whose load side ran out of CPU shows it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from docs_table import replace_section  # noqa: E402
from router_stub import CHUNKS, INTERVAL_S, new_event_loop, serve  # noqa: E402

SECTION = "router-latency"
ROUTER_CPU, LOAD_CPU = "0", "1"
STREAM_LEVELS = ((1, 15.0), (64, 10.0), (256, 10.0))  # (concurrent streams, measured seconds)
RATE_CONCURRENCY, RATE_SECONDS = 64, 8.0
WARMUP_S = 1.5
STREAM_S = (CHUNKS - 1) * INTERVAL_S  # one stream's length at the stub
GRACE_S = 30.0
TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(cmd: list[str], cpu: str, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.Popen(
        ["taskset", "-c", cpu, *cmd], stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env
    )


# --- accounting -------------------------------------------------------------------------------------


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, its threads and its descendants."""
    total = 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / TICKS
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                total += tree_cpu_s(int(child))
    except (FileNotFoundError, ProcessLookupError):
        pass
    return total


def core_busy() -> dict[str, tuple[int, int]]:
    """Per CPU: (busy ticks, all ticks) since boot."""
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and line[3:4].isdigit():
            name, *values = line.split()
            ticks = [int(v) for v in values]
            idle = ticks[3] + ticks[4]
            out[name[3:]] = (sum(ticks[:8]) - idle, sum(ticks[:8]))
    return out


@dataclass
class Window:
    """CPU use over a measured window: the router's process, this process, each core."""

    router_pid: int | None
    t0: float = field(default_factory=time.perf_counter)
    router0: float = 0.0
    self0: float = field(default_factory=time.process_time)
    cores0: dict[str, tuple[int, int]] = field(default_factory=core_busy)

    def __post_init__(self) -> None:
        self.router0 = tree_cpu_s(self.router_pid) if self.router_pid else 0.0

    def close(self) -> dict[str, float]:
        wall = time.perf_counter() - self.t0
        cores = core_busy()
        busy = {
            c: 100 * (cores[c][0] - b0) / max(1, cores[c][1] - a0)
            for c, (b0, a0) in self.cores0.items()
            if c in cores
        }
        router = (tree_cpu_s(self.router_pid) - self.router0) if self.router_pid else 0.0
        return {
            "router_cpu": 100 * router / wall,
            "load_cpu": 100 * (time.process_time() - self.self0) / wall,
            "core0": busy.get(ROUTER_CPU, 0.0),
            "core1": busy.get(LOAD_CPU, 0.0),
        }


# --- the load generator ------------------------------------------------------------------------------


class Lost(Exception):
    pass


class Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection, one request at a time. `request` resolves to
    (status, seconds to the first body byte, seconds to the end of the headers)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.fut: asyncio.Future[tuple[int, float, float]] | None = None
        self.buf = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.fut is not None and not self.fut.done():
            self.fut.set_exception(Lost(repr(exc)))

    def request(self, raw: bytes) -> asyncio.Future[tuple[int, float, float]]:
        if self.transport is None:
            raise Lost("closed")
        self.fut = asyncio.get_running_loop().create_future()
        self.buf = b""
        self.status = 0
        self.in_head = True
        self.chunked = False
        self.remaining = 0  # content-length bytes still to come
        self.skip = 0  # chunk data + CRLF still to come
        self.ttft = 0.0
        self.tth = 0.0  # to the end of the response headers
        self.t0 = time.perf_counter()
        self.transport.write(raw)
        return self.fut

    def data_received(self, data: bytes) -> None:
        if self.fut is None or self.fut.done():
            return
        if self.in_head:
            data = self.buf + data
            end = data.find(b"\r\n\r\n")
            if end < 0:
                self.buf = data
                return
            self.tth = time.perf_counter() - self.t0
            head = data[:end].lower()
            self.status = int(head[9:12])
            self.chunked = b"transfer-encoding: chunked" in head
            if not self.chunked:
                at = head.find(b"content-length:")
                eol = head.find(b"\r\n", at)
                self.remaining = int(head[at + 15 : eol if eol >= 0 else None]) if at >= 0 else 0
            self.in_head = False
            self.buf = b""
            data = data[end + 4 :]
            if not self.chunked and self.remaining == 0:
                self.ttft = time.perf_counter() - self.t0
                self._done()
                return
        if not data:
            return
        if not self.ttft:
            self.ttft = time.perf_counter() - self.t0
        if self.chunked:
            self._chunked(data)
        else:
            self.remaining -= len(data)
            if self.remaining <= 0:
                self._done()

    def _chunked(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        pos = 0
        while True:
            if self.skip:
                n = min(self.skip, len(buf) - pos)
                pos += n
                self.skip -= n
                if self.skip:
                    break
            nl = buf.find(b"\r\n", pos)
            if nl < 0:
                break
            size = int(buf[pos:nl].split(b";", 1)[0], 16)
            if size == 0:
                if len(buf) < nl + 4:
                    break  # the final CRLF is still to come
                self.buf = b""
                self._done()
                return
            pos = nl + 2
            self.skip = size + 2
        self.buf = buf[pos:]

    def _done(self) -> None:
        assert self.fut is not None
        self.fut.set_result((self.status, self.ttft, self.tth))


async def connect(port: int) -> Conn:
    loop = asyncio.get_running_loop()
    _, conn = await loop.create_connection(Conn, "127.0.0.1", port)
    return conn


async def reconnect(port: int) -> Conn:
    while True:
        try:
            return await connect(port)
        except OSError:
            await asyncio.sleep(0.1)


def post(port: int, path: str, body: dict[str, object]) -> bytes:
    data = json.dumps(body).encode()
    return (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n\r\n"
    ).encode() + data


def get(port: int, path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n\r\n".encode()


@dataclass
class Result:
    ttfts: list[float]  # seconds, requests started in the measured window that got a 200
    heads: list[float]  # seconds to the end of their response headers
    ok: int
    failed: int
    rate: float  # 200s completed in the window per second
    cpu: dict[str, float]
    failures: dict[int, int]  # status (0: connection lost, -1: no answer) -> count


async def closed_loop(
    port: int, raw: bytes, concurrency: int, seconds: float, router_pid: int | None
) -> Result:
    """`concurrency` connections, each sending its next request as soon as the last one ends, for a
    warm-up and then `seconds`; counts what started (TTFT) and what ended (rate) in the measured window."""
    conns = await asyncio.gather(*(connect(port) for _ in range(concurrency)))
    loop_start = time.perf_counter()
    begin, end = loop_start + WARMUP_S, loop_start + WARMUP_S + seconds
    ttfts: list[float] = []
    heads: list[float] = []
    counts = {"ok": 0, "failed": 0, "done_in_window": 0}
    statuses: Counter[int] = Counter()
    window: list[Window] = []

    async def worker(conn: Conn, delay: float) -> None:
        await asyncio.sleep(delay)
        while True:
            now = time.perf_counter()
            if now >= end:
                return
            if now >= begin and not window:
                window.append(Window(router_pid))
            measured = now >= begin
            try:
                status, ttft, tth = await conn.request(raw)
            except Lost:
                status, ttft, tth = 0, 0.0, 0.0
                conn = await reconnect(port)
            finished = time.perf_counter()
            if measured:
                if status == 200:
                    counts["ok"] += 1
                    ttfts.append(ttft)
                    heads.append(tth)
                else:
                    counts["failed"] += 1
                    statuses[status] += 1
            if status == 200 and begin <= finished < end:
                counts["done_in_window"] += 1

    # Clients start spread over one stream's length: started at one instant, a closed loop of equal
    # streams stays in lockstep, its requests arriving in a few bursts for good.
    spread = STREAM_S / concurrency
    tasks = [asyncio.ensure_future(worker(c, i * spread)) for i, c in enumerate(conns)]
    await asyncio.sleep(WARMUP_S + seconds)
    cpu = (window[0] if window else Window(router_pid)).close()
    _, pending = await asyncio.wait(tasks, timeout=GRACE_S)
    for task in pending:
        task.cancel()
    counts["failed"] += len(pending)
    for conn in conns:
        if conn.transport is not None:
            conn.transport.close()
    statuses[-1] += len(pending)  # still unanswered GRACE_S after the window
    rate = counts["done_in_window"] / seconds
    return Result(ttfts, heads, counts["ok"], counts["failed"], rate, cpu, dict(statuses))


async def wait_up(port: int, path: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            conn = await connect(port)
            status, _, _ = await asyncio.wait_for(conn.request(get(port, path)), 2.0)
            if conn.transport is not None:
                conn.transport.close()
            if status == 200:
                return
        except (OSError, Lost, TimeoutError):
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"port {port} did not answer 200 on {path}")


# --- the run --------------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    """The q-th percentile in ms (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))] * 1000


async def run(args: argparse.Namespace, tmp: Path) -> tuple[list[str], list[str]]:
    scale = args.scale
    stub_port, ours_port, sgl_port = free_port(), free_port(), free_port()
    server = await serve(stub_port)
    fleet = tmp / "fleet.toml"
    fleet.write_text(
        f'[[locations]]\ncode = "FRA"\nlat = 50.0\nlon = 8.5\n'
        f'[[locations.nodes]]\nid = "stub"\nurl = "http://127.0.0.1:{stub_port}"\n'
    )
    ours = [sys.executable, "-m", "edgeinfer.cli", "router", "--fleet", str(fleet), "--location", "FRA"]
    ours += ["--port", str(ours_port), "--stale-after-s", "5"]
    sgl = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--worker-urls",
        f"http://127.0.0.1:{stub_port}",
    ]
    sgl += ["--port", str(sgl_port), "--policy", "round_robin", "--log-level", "warn"]
    procs = {"edgeinfer router": spawn(ours, ROUTER_CPU, tmp / "ours.log")}
    if not args.quick:
        procs["sglang-router"] = spawn(sgl, ROUTER_CPU, tmp / "sglang.log")
    try:
        await wait_up(ours_port, "/ready")
        if not args.quick:
            await wait_up(sgl_port, "/health")
        await asyncio.sleep(1.0)
        # A router that died after answering once (a port of its own already taken) must not leave its
        # rows measuring whatever else answers there.
        if dead := [name for name, proc in procs.items() if proc.poll() is not None]:
            raise SystemExit(f"{', '.join(dead)} exited at start; its log is in {tmp}")
        targets = {"direct": (stub_port, None)}
        targets["edgeinfer router"] = (ours_port, procs["edgeinfer router"].pid)
        if not args.quick:
            targets["sglang-router"] = (sgl_port, procs["sglang-router"].pid)
        stream_rows: list[str] = []
        for concurrency, seconds in STREAM_LEVELS:
            if args.streams and concurrency not in args.streams:
                continue
            results = {}
            for name, (port, pid) in targets.items():
                body = {"model": "stub", "prompt": "hi", "max_tokens": CHUNKS, "stream": True}
                results[name] = await closed_loop(
                    port, post(port, "/v1/completions", body), concurrency, seconds * scale, pid
                )
            base = results["direct"].ttfts
            for name, r in results.items():
                added = (
                    ""
                    if name == "direct"
                    else (
                        f"{pct(r.ttfts, 50) - pct(base, 50):+.2f} / {pct(r.ttfts, 99) - pct(base, 99):+.2f}"
                    )
                )
                stream_rows.append(
                    f"| {name} | {concurrency} | {outcome(r)} | {pct(r.ttfts, 50):.2f} / "
                    f"{pct(r.ttfts, 99):.2f} | {added} | {pct(r.heads, 50):.2f} | {r.rate:.0f} "
                    f"| {cpu_cells(r, name)} |"
                )
        rate_rows: list[str] = []
        for name, (port, pid) in targets.items() if args.rate else ():
            body = {"model": "stub", "prompt": "hi", "max_tokens": 1, "stream": True}
            r = await closed_loop(
                port, post(port, "/v1/completions", body), RATE_CONCURRENCY, RATE_SECONDS * scale, pid
            )
            rate_rows.append(
                f"| {name} | {RATE_CONCURRENCY} | {outcome(r)} | {r.rate:.0f} | "
                f"{pct(r.ttfts, 50):.2f} / {pct(r.ttfts, 99):.2f} | {cpu_cells(r, name)} |"
            )
        return stream_rows, rate_rows
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(20)
        server.close()


def outcome(r: Result) -> str:
    names = {0: "connection lost", -1: "unanswered"}
    why = ", ".join(f"{n} × {names.get(code, code)}" for code, n in sorted(r.failures.items()) if n)
    return f"{r.ok}/{r.failed}" + (f" ({why})" if why else "")


def cpu_cells(r: Result, name: str) -> str:
    """Router CPU % and µs of router CPU per answered request, stub + load CPU %, each core's busy %."""
    router = per_request = ""
    if name != "direct":
        router = f"{r.cpu['router_cpu']:.0f}"
        per_request = f"{r.cpu['router_cpu'] / 100 / r.rate * 1e6:.0f}" if r.rate else "–"
    load = f"{r.cpu['load_cpu']:.0f} | {r.cpu['core0']:.0f} / {r.cpu['core1']:.0f}"
    return f"{router} | {per_request} | {load}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", default=None, help="replace this file's router-latency section")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply each window's length (quick runs)")
    parser.add_argument(
        "--streams", type=int, nargs="+", default=None, help="only these stream levels (of 1, 64, 256)"
    )
    parser.add_argument("--quick", action="store_true", help="the edgeinfer router only (iterating)")
    parser.add_argument("--no-rate", dest="rate", action="store_false", help="no requests/s run (iterating)")
    args = parser.parse_args()
    if args.write and (args.quick or args.streams or not args.rate):
        parser.error("--write takes the whole run, the peer's rows too: no --quick, --streams or --no-rate")
    os.sched_setaffinity(0, {int(LOAD_CPU)})
    tmp = Path(tempfile.mkdtemp(prefix="router-bench-"))
    load_before = os.getloadavg()
    loop = new_event_loop()
    try:
        stream_rows, rate_rows = loop.run_until_complete(run(args, tmp))
    finally:
        loop.close()
    report = render(stream_rows, rate_rows, load_before, os.getloadavg(), args)
    print(report)
    print(f"router logs: {tmp}", file=sys.stderr)
    if args.write:
        replace_section(Path(args.write), SECTION, report)
    return 0


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def render(
    stream_rows: list[str],
    rate_rows: list[str],
    load_before: tuple[float, float, float],
    load_after: tuple[float, float, float],
    args: argparse.Namespace,
) -> str:
    info = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), platform.processor()
    )
    flags = next((ln.split(":", 1)[1].split() for ln in info if ln.startswith("flags")), [])
    simd = " ".join(f for f in ("sse4_2", "avx2", "avx512f", "avx512_vnni", "amx_tile") if f in flags)
    mhz = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("cpu MHz")), "?")
    command = "python bench/router_latency.py" + (f" --write {args.write}" if args.write else "")
    if args.scale != 1.0:
        command += f" --scale {args.scale}"
    if args.streams:
        command += " --streams " + " ".join(map(str, args.streams))
    if args.quick:
        command += " --quick"
    if not args.rate:
        command += " --no-rate"

    def load(avg: tuple[float, float, float]) -> str:
        return " / ".join(f"{v:.2f}" for v in avg)

    return "\n".join(
        [
            "### Router: added latency (edgeinfer router vs sglang-router)",
            "",
            f"Machine: {cpu} ({mhz} MHz, flags incl. {simd or 'none of sse4_2/avx2/avx512f'}), "
            f"{os.cpu_count()} CPUs, Linux {platform.release()}, Python {platform.python_version()}, "
            f"uvloop {_version('uvloop')}, httptools {_version('httptools')}, sglang-router "
            f"{_version('sglang-router')}. Load average (1 / 5 / 15 min) {load(load_before)} before, "
            f"{load(load_after)} after.",
            "",
            f"Each router pinned to CPU {ROUTER_CPU} (`taskset -c {ROUTER_CPU}`): sglang-router "
            "`--policy round_robin`, the edgeinfer router polling the stub's /node/status with "
            "`--stale-after-s 5`. The stub node (bench/router_stub.py) and the load generator share one "
            f"process and one uvloop event loop pinned to CPU {LOAD_CPU}, on raw asyncio protocols "
            "(keep-alive HTTP/1.1, no HTTP library). Closed loop: each of N connections sends its next "
            "request when the last one ends, the connections' first requests spread over one stream's length "
            "(started at one instant, equal streams stay in lockstep and arrive in bursts for good); "
            f"{WARMUP_S:g} s warm-up, then a measured window "
            f"({', '.join(f'{s * args.scale:g} s at {c}' for c, s in STREAM_LEVELS)}; "
            f"{RATE_SECONDS * args.scale:g} s for requests/s). Stub stream: {CHUNKS} SSE chunks, the first "
            f"at once, then one per {INTERVAL_S * 1000:g} ms. TTFT = request written to first body byte "
            "read; headers = request written to the end of the response headers; added = TTFT through the "
            "router minus direct at the same concurrency. CPU columns: % of one "
            "core over the window, for the router process, for the stub + load process, and for each whole "
            "core (anything else running shows there); CPU µs/request: the router process's CPU time over "
            "the window divided by the requests completed in it.",
            f"Command: `{command}`",
            "",
            "| target | streams | ok/failed | TTFT p50 / p99 ms | added p50 / p99 ms | headers p50 ms "
            "| requests/s | router CPU % | router CPU µs/request | stub+load CPU % | core 0 / 1 busy % |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
            *stream_rows,
            "",
            "Routed requests/s on one core: the same closed loop with one-chunk streams (`max_tokens: 1`, "
            "the stub answers in one write), latency = request written to first body byte.",
            "",
            "| target | connections | ok/failed | requests/s | latency p50 / p99 ms | router CPU % "
            "| router CPU µs/request | stub+load CPU % | core 0 / 1 busy % |",
            "|---|---|---|---|---|---|---|---|---|",
            *rate_rows,
        ]
    )


if __name__ == "__main__":
    raise SystemExit(main())
