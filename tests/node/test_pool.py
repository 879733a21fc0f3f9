"""Pool policy and manager on CPU with a stand-in loader (the real engine runs in test_pool_e2e.py)."""

from __future__ import annotations

import asyncio

import pytest

from edgeinfer.pool.loader import MemberLoader
from edgeinfer.pool.manager import ModelPool, PoolCapacityError, UnknownModelError
from edgeinfer.pool.member import MemberStats, PoolMember
from edgeinfer.pool.policy import DecayingRate, ResidentView, TrafficWeightedLRU
from edgeinfer.pool.spec import LOCAL, MemberSpec, parse_bytes, parse_model_arg, parse_upstream_arg


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class StubMember(PoolMember):
    kind = "local"

    def __init__(self, name: str, size: int) -> None:
        self.name, self.version, self.size, self.closed = name, "v1", size, False

    def memory_bytes(self) -> int:
        return self.size

    def stats(self) -> MemberStats:
        return MemberStats(0, 0)

    def health(self) -> str | None:
        return None

    async def close(self) -> None:
        self.closed = True


class StubLoader(MemberLoader):
    """Loads take as long as `gate` stays closed; sizes can differ from estimates."""

    def __init__(self, sizes: dict[str, int], estimates: dict[str, int] | None = None) -> None:
        self.sizes, self.estimates = sizes, estimates or sizes
        self.loads: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail: Exception | None = None

    def estimate_bytes(self, spec: MemberSpec) -> int:
        return self.estimates[spec.name]

    async def load(self, spec: MemberSpec) -> PoolMember:
        self.loads.append(spec.name)
        await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        return StubMember(spec.name, self.sizes[spec.name])


class Events:
    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []

    def on_load(self, name: str, seconds: float, memory_bytes: int) -> None:
        self.log.append(("load", name))

    def on_evict(self, name: str, memory_bytes: int) -> None:
        self.log.append(("evict", name))


def _pool(sizes: dict[str, int], budget: int | None, pinned: tuple[str, ...] = (), **kw) -> tuple:
    loader = StubLoader(sizes, kw.pop("estimates", None))
    events, clock = Events(), Clock()
    specs = [MemberSpec(n, LOCAL, f"/m/{n}", pinned=n in pinned) for n in sizes]
    return ModelPool(specs, loader, budget, listener=events, clock=clock), loader, events, clock


def _view(name: str, idle: float, recent: float, **kw) -> ResidentView:
    return ResidentView(
        name, kw.get("size", 100), idle, recent, kw.get("in_flight", 0), kw.get("pinned", False)
    )


def test_decaying_rate_halves_every_half_life() -> None:
    rate = DecayingRate(half_life_s=10)
    for _ in range(8):
        rate.hit(0.0)
    assert rate.value(10.0) == pytest.approx(4.0)
    assert rate.value(20.0) == pytest.approx(2.0)


def test_traffic_buys_time_against_plain_recency() -> None:
    policy = TrafficWeightedLRU()
    busy_but_older = _view("busy", idle=60, recent=30)
    idle_but_recent = _view("quiet", idle=10, recent=0)
    assert policy.choose_victims([busy_but_older, idle_but_recent], 100) == ["quiet"]
    assert policy.choose_victims([busy_but_older, idle_but_recent], 150) == ["quiet", "busy"]


def test_pinned_and_in_flight_are_never_victims() -> None:
    policy = TrafficWeightedLRU()
    views = [_view("pinned", 999, 0, pinned=True), _view("serving", 999, 0, in_flight=1), _view("idle", 1, 5)]
    assert policy.choose_victims(views, 100) == ["idle"]
    assert policy.choose_victims(views, 101) is None
    assert policy.choose_victims(views, 0) == []


def test_requests_during_a_load_wait_for_that_one_load() -> None:
    async def main() -> None:
        pool, loader, events, _ = _pool({"a": 100}, budget=None)
        loader.gate.clear()
        waiters = [asyncio.create_task(pool.acquire("a")) for _ in range(5)]
        await asyncio.sleep(0.01)
        assert pool.states()[0].state == "loading" and pool.waiting_for_load("a") == 5
        loader.gate.set()
        leases = await asyncio.gather(*waiters)
        assert loader.loads == ["a"] and events.log == [("load", "a")]
        assert len({id(lease.member) for lease in leases}) == 1
        assert pool.in_flight("a") == 5
        for lease in leases:
            lease.release()
        assert pool.in_flight("a") == 0

    asyncio.run(main())


def test_idle_member_is_evicted_for_a_new_one_and_reloads() -> None:
    async def main() -> None:
        pool, loader, events, clock = _pool({"a": 100, "b": 100}, budget=150)
        async with pool.lease("a") as a:
            pass
        clock.now = 5.0
        async with pool.lease("b"):
            assert a.closed and not pool.is_resident("a")
        async with pool.lease("a"):
            pass
        assert loader.loads == ["a", "b", "a"]
        assert events.log == [("load", "a"), ("evict", "a"), ("load", "b"), ("evict", "b"), ("load", "a")]
        assert pool.used_bytes() == 100

    asyncio.run(main())


def test_member_with_requests_in_flight_is_not_evicted() -> None:
    async def main() -> None:
        pool, _, _, _ = _pool({"a": 100, "b": 100}, budget=150)
        held = await pool.acquire("a")
        with pytest.raises(PoolCapacityError, match="busy or pinned"):
            await pool.acquire("b")
        assert pool.is_resident("a") and pool.in_flight("b") == 0
        held.release()
        (await pool.acquire("b")).release()
        assert not pool.is_resident("a")

    asyncio.run(main())


def test_pinned_member_stays() -> None:
    async def main() -> None:
        pool, _, _, _ = _pool({"a": 100, "b": 100}, budget=150, pinned=("a",))
        await pool.preload(["a"])
        with pytest.raises(PoolCapacityError):
            await pool.acquire("b")
        assert pool.is_resident("a")

    asyncio.run(main())


def test_too_big_for_the_whole_budget() -> None:
    async def main() -> None:
        pool, loader, _, _ = _pool({"big": 500}, budget=100)
        with pytest.raises(PoolCapacityError, match="more than the pool budget"):
            await pool.acquire("big")
        assert loader.loads == []

    asyncio.run(main())


def test_underestimated_load_evicts_idle_members_afterwards() -> None:
    async def main() -> None:
        pool, _, events, clock = _pool({"a": 100, "b": 180}, budget=200, estimates={"a": 100, "b": 50})
        await pool.preload(["a"])
        clock.now = 1.0
        await pool.preload(["b"])  # estimated 50 fits next to a; it really takes 180
        assert events.log[-1] == ("evict", "a")
        assert pool.used_bytes() == 180

    asyncio.run(main())


def test_failed_load_reaches_every_waiter_and_is_retried() -> None:
    async def main() -> None:
        pool, loader, _, _ = _pool({"a": 100}, budget=None)
        loader.gate.clear()
        loader.fail = ValueError("bad checkpoint")
        waiters = [asyncio.create_task(pool.acquire("a")) for _ in range(3)]
        await asyncio.sleep(0.01)
        loader.gate.set()
        results = await asyncio.gather(*waiters, return_exceptions=True)
        assert all(isinstance(r, ValueError) for r in results)
        assert pool.in_flight("a") == 0 and pool.states()[0].state == "unloaded"
        loader.fail = None
        (await pool.acquire("a")).release()
        assert loader.loads == ["a", "a"]

    asyncio.run(main())


def test_a_cancelled_waiter_does_not_cancel_the_load() -> None:
    async def main() -> None:
        pool, loader, _, _ = _pool({"a": 100}, budget=None)
        loader.gate.clear()
        gone = asyncio.create_task(pool.acquire("a"))
        stays = asyncio.create_task(pool.acquire("a"))
        await asyncio.sleep(0.01)
        gone.cancel()
        await asyncio.sleep(0.01)
        loader.gate.set()
        (await stays).release()
        assert pool.is_resident("a") and pool.in_flight("a") == 0 and loader.loads == ["a"]

    asyncio.run(main())


def test_names_aliases_and_errors() -> None:
    spec = MemberSpec("gemma-3-270m", LOCAL, "gemma-3-270m", aliases=("@cf/google/gemma-3-270m",))
    pool = ModelPool([spec], StubLoader({"gemma-3-270m": 1}))
    assert pool.resolve("@cf/google/gemma-3-270m") == "gemma-3-270m"
    with pytest.raises(UnknownModelError, match="gemma-3-270m"):
        pool.resolve("llama")
    with pytest.raises(ValueError, match="twice"):
        ModelPool([spec, MemberSpec("@cf/google/gemma-3-270m", LOCAL, "x")], StubLoader({}))
    with pytest.raises(ValueError, match="at least one"):
        ModelPool([], StubLoader({}))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2GiB", 2 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("1000", 1000),
        ("64 kib", 65536),
    ],
)
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["", "2XB", "-1GiB", "0", "GiB"])
def test_parse_bytes_rejects(bad: str) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_bytes(bad)


def test_member_args() -> None:
    spec = parse_model_arg("@cf/meta/llama=/models/llama")
    assert (spec.name, spec.target) == ("@cf/meta/llama", "/models/llama")
    assert parse_model_arg("gemma-3-270m").target == "gemma-3-270m"
    assert parse_upstream_arg("big=http://10.0.0.2:8000/v1").target == "http://10.0.0.2:8000/v1"
    with pytest.raises(ValueError, match="URL"):
        parse_upstream_arg("big=10.0.0.2:8000")
    with pytest.raises(ValueError, match="NAME=PATH"):
        parse_model_arg("=x")
