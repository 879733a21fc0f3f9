"""Tenants files, key hashing, cache namespaces, prices and the append-only usage store."""

from __future__ import annotations

import json
import sqlite3
import time

import pytest

from edgeinfer.api.errors import ApiError
from edgeinfer.api.files import load_table
from edgeinfer.api.keys import generate_key, hash_key, tenant_snippet
from edgeinfer.api.prices import Price
from edgeinfer.api.tenants import TenantRegistry, cache_namespace
from edgeinfer.node.billing.metering import UsageRecord, UsageStore
from edgeinfer.node.billing.prices import PriceTable
from edgeinfer.node.keys import main

SECRET = b"s" * 32


def _record(*values: object) -> UsageRecord:
    """A usage row from its values in the table's column order."""
    return UsageRecord.from_row(values)


def test_toml_and_json_tenant_files(tmp_path) -> None:
    key = generate_key()
    toml = tmp_path / "t.toml"
    toml.write_text(
        tenant_snippet("acme", key) + "requests_per_minute = 60\n[tenants.prices.tiny]\noutput = 9.0\n"
    )
    as_json = tmp_path / "t.json"
    as_json.write_text(
        json.dumps({"tenants": [{"name": "acme", "key_sha256": hash_key(key), "max_concurrent": 2}]})
    )
    for path in (toml, as_json):
        registry = TenantRegistry.from_mapping(load_table(path), SECRET)
        tenant = registry.authenticate(f"Bearer {key}")
        assert tenant.name == "acme" and not registry.is_open
    toml_tenant = TenantRegistry.from_mapping(load_table(toml), SECRET).authenticate(f"Bearer {key}")
    assert toml_tenant.limits.requests_per_minute == 60
    assert PriceTable().price("tiny", toml_tenant.prices).output == 9.0
    assert PriceTable().price("tiny", toml_tenant.prices).input == Price().input  # partial override


@pytest.mark.parametrize(
    ("header", "needle"),
    [(None, "missing"), ("Basic abc", "malformed"), ("Bearer wrong", "invalid")],
)
def test_bad_credentials_are_401(header: str | None, needle: str) -> None:
    registry = TenantRegistry.from_mapping({"tenants": [{"name": "a", "key_sha256": hash_key("k")}]}, SECRET)
    with pytest.raises(ApiError) as exc:
        registry.authenticate(header)
    assert exc.value.status == 401 and needle in exc.value.message


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({}, "tenants"),
        ({"tenants": [{"name": "a", "key_sha256": "abc"}]}, "64 hex"),
        ({"tenants": [{"name": "a", "key_sha256": hash_key("k"), "rpm": 3}]}, "unknown field"),
        ({"tenants": [{"name": "a", "key_sha256": hash_key("k"), "max_concurrent": 0}]}, "max_concurrent"),
        (
            {
                "tenants": [
                    {"name": "a", "key_sha256": hash_key("k")},
                    {"name": "a", "key_sha256": hash_key("j")},
                ]
            },
            "duplicate",
        ),
        (
            {"tenants": [{"name": "a", "key_sha256": hash_key("k"), "prices": {"m": {"inp": 1}}}]},
            "unknown price",
        ),
    ],
)
def test_bad_tenant_files_name_the_problem(data: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        TenantRegistry.from_mapping(data, SECRET)


def test_open_mode_says_so(caplog) -> None:
    registry = TenantRegistry.open(SECRET)
    assert registry.is_open and registry.authenticate(None).name == "default"
    assert "OPEN" in caplog.text


def test_cache_namespace_is_server_derived() -> None:
    assert cache_namespace(SECRET, "a") == cache_namespace(SECRET, "a")
    assert cache_namespace(SECRET, "a") != cache_namespace(SECRET, "b")
    assert cache_namespace(SECRET, "a") != cache_namespace(b"other", "a")


def test_keys_cli(capsys) -> None:
    assert main(["hash", "abc"]) == 0
    assert capsys.readouterr().out.strip() == hash_key("abc")
    assert main(["new", "acme"]) == 0
    out = capsys.readouterr().out
    key = out.split()[out.split().index("stored):") + 1]
    assert hash_key(key) in out
    assert main([]) == 2


def test_price_discounts_cached_input() -> None:
    price = Price(input=100, cached_input=10, output=400)
    assert price.cost(1000, 0, 0) == pytest.approx(0.1)
    assert price.cost(1000, 1000, 0) == pytest.approx(0.01)
    assert price.cost(1000, 600, 500) == pytest.approx((400 * 100 + 600 * 10 + 500 * 400) / 1e6)
    table = PriceTable.from_mapping({"default": {"output": 1}, "models": {"m": {"input": 5}}})
    assert table.price("m") == Price(input=5, cached_input=10, output=1)
    with pytest.raises(ValueError, match="input"):
        Price(input=-1)


def test_usage_store_is_append_only_and_sums_per_tenant(tmp_path) -> None:
    store = UsageStore(str(tmp_path / "u.sqlite"))
    now = time.time()
    for i, tenant in enumerate(["a", "a", "b"]):
        store.append(_record(now + i, tenant, "m", f"r{i}", "completions", 200, 10, 4, 5, 0.5))
    store.append(_record(now, "a", "other", "r9", "chat.completions", 499, 3, 0, 1, 0.1))
    store.flush()
    summary = {row["model"]: row for row in store.summary("a")}
    assert summary["m"]["requests"] == 2 and summary["m"]["input_tokens"] == 20
    assert summary["m"]["cached_input_tokens"] == 8 and summary["m"]["output_tokens"] == 10
    assert summary["other"]["cost_units"] == pytest.approx(0.1)
    assert [row["model"] for row in store.summary("a", start=now + 0.5)] == ["m"]
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        store._conn.execute("UPDATE usage SET output_tokens = 0")
    assert store._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    store.close()
    reopened = UsageStore(str(tmp_path / "u.sqlite"))
    assert len(reopened.records("a")) == 3
    reopened.close()
