"""Fixtures of the ledger tests: a throwaway PostgreSQL cluster (skipped only where its binaries are absent)
and the two stores the ledger offers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers.postgres import PostgresCluster, fresh_database, postgres_bindir, throwaway_postgres

from edgeinfer.ledger.store import LedgerStore, open_postgres, open_sqlite


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[PostgresCluster]:
    if postgres_bindir() is None:
        pytest.skip("PostgreSQL server binaries not found (Debian: apt-get install postgresql)")
    with throwaway_postgres() as cluster:
        yield cluster


@pytest.fixture
def postgres_url(postgres_cluster: PostgresCluster) -> str:
    """An empty database of its own for each test."""
    return fresh_database(postgres_cluster.url)


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path) -> Iterator[LedgerStore]:
    if request.param == "sqlite":
        opened = open_sqlite(str(tmp_path / "ledger.sqlite"))
    else:
        opened = open_postgres(request.getfixturevalue("postgres_url"))
    yield opened
    opened.close()
