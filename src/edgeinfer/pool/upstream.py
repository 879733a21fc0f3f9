"""An external OpenAI-compatible engine (SGLang, vLLM, llama.cpp, another edgeinfer) as a pool member."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from edgeinfer.pool.member import MemberStats, PoolMember
from edgeinfer.pool.upstream_stats import StatsPoller

if TYPE_CHECKING:  # httpx is imported where it is used: every node imports this module at start, and
    import httpx  # httpx (with its CLI's rich) is a noticeable part of a start that fronts no upstream

# How often an upstream's own metrics are read: admission (rejectIfBusy, queue depth) sees its queue at
# most this stale.
STATS_INTERVAL_S = 0.25


class UpstreamError(Exception):
    """The upstream answered with an error status, or could not be reached (status 502)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class UpstreamMember(PoolMember):
    """Talks to `base_url` over HTTP; requests are sent with the upstream's own model id. Its stats are
    the upstream's own gauges (pool/upstream_stats.py), or what this node has in flight there when the
    upstream shows none."""

    kind = "upstream"

    def __init__(
        self, name: str, base_url: str, served_model: str, client: httpx.AsyncClient, tokenizer: Any = None
    ) -> None:
        self.name = name
        self.tokenizer = tokenizer  # the served model's (an edgeinfer Tokenizer), to count prompt tokens
        self.base_url = base_url
        self.served_model = served_model
        self.version = f"upstream:{served_model}"
        self._client = client
        self._in_flight = 0
        self.poller = StatsPoller(client, served_model, STATS_INTERVAL_S)

    @classmethod
    async def connect(
        cls, name: str, url: str, timeout_s: float = 300.0, tokenizer: Any = None
    ) -> UpstreamMember:
        """Reach the upstream, learn which model id to send (`name` if it serves that, else its first)
        and start reading its stats."""
        import httpx

        base = normalize_base_url(url)
        # Long read timeout: a streamed generation may pause between tokens on a busy upstream.
        client = httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(timeout_s, connect=5.0))
        try:
            ids = await _model_ids(client, base)
        except BaseException:
            await client.aclose()
            raise
        served = name if name in ids else ids[0]
        member = cls(name, base, served, client, tokenizer)
        await member.poller.poll()  # the first request already sees the upstream's load
        member.poller.start()
        return member

    def memory_bytes(self) -> int:
        return 0

    def stats(self) -> MemberStats:
        return self.poller.latest or MemberStats(self._in_flight, 0)

    def health(self) -> str | None:
        return self.poller.error

    async def close(self) -> None:
        await self.poller.stop()
        await self._client.aclose()

    async def post_json(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST `body` (with our model id) and return the JSON answer; UpstreamError on failure."""
        import httpx

        self._in_flight += 1
        try:
            response = await self._client.post(path, json=self._with_model(body))
        except httpx.HTTPError as exc:
            raise UpstreamError(502, f"upstream {self.name} ({self.base_url}) failed: {exc!r}") from exc
        finally:
            self._in_flight -= 1
        if response.status_code >= 400:
            raise UpstreamError(response.status_code, _error_message(response.content, response.status_code))
        try:
            return response.json()
        except ValueError as exc:
            raise UpstreamError(
                502, f"upstream {self.name} answered non-JSON: {response.text[:200]!r}"
            ) from exc

    async def stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """POST a streaming request; yield each SSE event's JSON until `[DONE]`.

        Closing the generator early closes the HTTP response, which the upstream sees as a disconnect
        and aborts its request.
        """
        import httpx

        self._in_flight += 1
        try:
            async with self._client.stream("POST", path, json=self._with_model(body)) as response:
                if response.status_code >= 400:
                    content = await response.aread()
                    raise UpstreamError(response.status_code, _error_message(content, response.status_code))
                async for data in _sse_data(response.aiter_lines()):
                    if data == "[DONE]":
                        return
                    yield _parse_event(data, self.name)
        except httpx.HTTPError as exc:
            raise UpstreamError(502, f"upstream {self.name} ({self.base_url}) failed: {exc!r}") from exc
        finally:
            self._in_flight -= 1

    def _with_model(self, body: dict[str, Any]) -> dict[str, Any]:
        return {**body, "model": self.served_model}


def normalize_base_url(url: str) -> str:
    """`http://h:8000/v1/` → `http://h:8000` (paths we send start with /v1)."""
    base = url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


async def _model_ids(client: httpx.AsyncClient, base: str) -> list[str]:
    import httpx

    try:
        response = await client.get("/v1/models")
    except httpx.HTTPError as exc:
        raise UpstreamError(502, f"upstream {base} unreachable: {exc!r}") from exc
    if response.status_code >= 400:
        raise UpstreamError(502, f"upstream {base}/v1/models answered {response.status_code}")
    try:
        ids = [entry["id"] for entry in response.json()["data"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise UpstreamError(502, f"upstream {base}/v1/models is not an OpenAI model list") from exc
    if not ids:
        raise UpstreamError(502, f"upstream {base} serves no models")
    return ids


async def _sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """Join the `data:` lines of each event (events end at a blank line); skip comments and other fields."""
    buffer: list[str] = []
    async for line in lines:
        if line.startswith("data:"):
            buffer.append(line[5:].removeprefix(" "))
        elif not line.strip() and buffer:
            yield "\n".join(buffer)
            buffer = []
    if buffer:
        yield "\n".join(buffer)


def _parse_event(data: str, name: str) -> dict[str, Any]:
    try:
        event = json.loads(data)
    except ValueError as exc:
        raise UpstreamError(502, f"upstream {name} sent a non-JSON event: {data[:200]!r}") from exc
    if isinstance(event, dict) and "error" in event and "choices" not in event:
        raise UpstreamError(502, f"upstream {name} failed mid-stream: {_message_of(event)}")
    return event


def _error_message(content: bytes, status: int) -> str:
    try:
        return _message_of(json.loads(content))
    except ValueError:
        return content.decode("utf-8", "replace")[:500] or f"upstream answered HTTP {status}"


def _message_of(payload: Any) -> str:
    """OpenAI `{"error": {"message"}}`, Workers-AI `{"errors": [{"message"}]}` or FastAPI `{"detail"}`."""
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if isinstance(error, str):
            return error
        errors = payload.get("errors")
        if isinstance(errors, list) and errors and isinstance(errors[0], dict):
            return str(errors[0].get("message", errors[0]))
        if "detail" in payload:
            return str(payload["detail"])
    return json.dumps(payload)[:500]
