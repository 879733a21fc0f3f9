"""`edgeinfer ledger` as a new user runs it: a fresh process with an empty home, its default store, SIGTERM
to stop; a mistake (a bad flag, an unreachable PostgreSQL, a NATS without JetStream) is one line."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from pathlib import Path

import nats
import pytest
from helpers.jetstream import JetStream
from helpers.new_user import EDGEINFER, assert_one_line_error, new_home, new_user_env, run_edgeinfer
from helpers.router_fleet import free_port

from edgeinfer.api.usage_stream import ensure_stream, usage_stream_config
from edgeinfer.fleet.nats_server import nats_server_binary
from edgeinfer.ledger.client import LedgerUnavailable, query_usage
from edgeinfer.types.usage_event import UsageEvent

pytestmark = pytest.mark.cli


async def _publish_and_query(url: str, event: UsageEvent, timeout: float = 30.0) -> list[dict]:
    """Publish `event`, then ask until the ledger has it."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await ensure_stream(js, usage_stream_config())
        await js.publish(event.subject, event.to_json(), headers={"Nats-Msg-Id": event.event_id})
        deadline = time.monotonic() + timeout
        while True:
            try:
                if rows := await query_usage(nc, event.tenant, None, None):
                    return rows
            except LedgerUnavailable:
                pass
            assert time.monotonic() < deadline, "the ledger never stored the event"
            await asyncio.sleep(0.05)
    finally:
        await nc.close()


def test_the_ledger_runs_in_a_fresh_home_and_stops_on_sigterm(tmp_path: Path) -> None:
    server = JetStream(tmp_path).start()
    home = new_home(tmp_path)
    ledger = subprocess.Popen(
        [*EDGEINFER, "ledger", "--nats-url", server.url],
        env=new_user_env(home),
        cwd=home,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    event = UsageEvent(
        request_id="r1",
        node_id="fra-1",
        tenant="acme",
        model="tiny",
        endpoint="completions",
        status=200,
        input_tokens=4,
        cached_input_tokens=0,
        output_tokens=6,
        cost_units=0.5,
        ts=time.time(),
    )
    try:
        rows = asyncio.run(_publish_and_query(server.url, event))
        ledger.send_signal(signal.SIGTERM)
        assert ledger.wait(20) == 0
    finally:
        if ledger.poll() is None:
            ledger.kill()
        server.stop()
    output = ledger.communicate()[0]
    assert "Traceback" not in output, output
    assert rows == [
        {
            "model": "tiny",
            "requests": 1,
            "input_tokens": 4,
            "cached_input_tokens": 0,
            "output_tokens": 6,
            "cost_units": 0.5,
        }
    ]
    assert (home / ".local" / "state" / "edgeinfer" / "ledger.sqlite").exists()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--batch-size", "0"], "--batch-size must be >= 1"),
        (["--postgres-url", "postgresql://ledger@/ledger?host=/nonexistent"], "cannot connect to PostgreSQL"),
    ],
)
def test_a_ledger_mistake_is_one_line(tmp_path: Path, args: list[str], says: str) -> None:
    assert_one_line_error(run_edgeinfer(["ledger", *args], new_home(tmp_path), timeout=60), "ledger", says)


def test_a_nats_without_jetstream_is_one_line(tmp_path: Path) -> None:
    port = free_port()
    with open(tmp_path / "nats.log", "wb") as log:
        server = subprocess.Popen(
            [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)], stdout=log, stderr=log
        )
    try:  # the ledger waits for the server to accept, then asks it for its streams
        res = run_edgeinfer(
            ["ledger", "--nats-url", f"nats://127.0.0.1:{port}"], new_home(tmp_path), timeout=60
        )
    finally:
        server.terminate()
        server.wait(10)
    assert_one_line_error(res, "ledger", "the NATS server has no JetStream")
