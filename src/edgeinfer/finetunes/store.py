"""Where finetunes live: a directory for a lone node, NATS JetStream for a fleet (every router and node sees
the same finetunes, so an upload through any of them serves everywhere).

Records are keyed `<tenant token>.<name>`: a name is unique per tenant, and one tenant's keys are never
read for another's. Assets are stored per finetune id and file name; a record names each asset's sha256,
so a node that holds an older copy on disk sees that it changed.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING

from edgeinfer.api.errors import bad_request
from edgeinfer.finetunes.records import ASSET_FILES, MAX_FINETUNES_PER_TENANT, Finetune

if TYPE_CHECKING:
    from nats.js import JetStreamContext
    from nats.js.kv import KeyValue
    from nats.js.object_store import ObjectStore

logger = logging.getLogger("edgeinfer.finetunes")

RECORDS_BUCKET = "edgeinfer_finetunes"
ASSETS_BUCKET = "edgeinfer_finetune_assets"


def tenant_token(tenant: str) -> str:
    """A key token for a tenant's name, which may hold any character."""
    return hashlib.sha256(tenant.encode()).hexdigest()[:24]


def name_taken(name: str) -> Exception:
    return bad_request(f"a finetune named {name!r} exists in this account", "name")


class FinetuneStore(ABC):
    @abstractmethod
    async def create(self, finetune: Finetune) -> None:
        """Store a new finetune; 400 if the tenant has one of that name (or too many)."""

    @abstractmethod
    async def save(self, finetune: Finetune) -> None:
        """Replace the finetune's record."""

    @abstractmethod
    async def list(self, tenant: str) -> list[Finetune]:
        """The tenant's finetunes, oldest first."""

    @abstractmethod
    async def put_asset(self, finetune: Finetune, file_name: str, data: bytes) -> None: ...

    @abstractmethod
    async def asset(self, finetune: Finetune, file_name: str) -> bytes: ...

    async def find(self, tenant: str, name_or_id: str) -> Finetune | None:
        """The tenant's finetune of that name or id (None: none, or only another tenant's)."""
        for finetune in await self.list(tenant):
            if name_or_id in (finetune.name, finetune.id):
                return finetune
        return None

    async def add_asset(self, finetune: Finetune, file_name: str, data: bytes) -> Finetune:
        """Store an uploaded file, then the record that names it: a record never names a missing asset."""
        await self.put_asset(finetune, file_name, data)
        updated = finetune.with_asset(file_name, hashlib.sha256(data).hexdigest())
        await self.save(updated)
        return updated

    async def materialize(self, finetune: Finetune, root: Path) -> Path:
        """A directory holding the finetune's two files as they are now (a PEFT adapter directory), made
        under `root` once per revision."""
        directory = root / tenant_token(finetune.tenant) / finetune.id / finetune.revision
        if all((directory / name).is_file() for name in ASSET_FILES):
            return directory
        files = {name: await self.asset(finetune, name) for name in ASSET_FILES}
        await asyncio.to_thread(_write_files, directory, files)
        return directory


def _write_files(directory: Path, files: dict[str, bytes]) -> None:
    """Write each file beside its final name, then rename it: a reader never sees half a file."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        partial = directory / f".{name}.{os.getpid()}.partial"
        partial.write_bytes(data)
        partial.replace(directory / name)


class LocalFinetunes(FinetuneStore):
    """A lone node's finetunes, in `root/<tenant token>/<name>/` (the record and its assets)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock = asyncio.Lock()  # create checks, then writes

    def _dir(self, finetune: Finetune) -> Path:
        return self.root / tenant_token(finetune.tenant) / finetune.name

    async def create(self, finetune: Finetune) -> None:
        async with self._lock:
            existing = await self.list(finetune.tenant)
            if any(f.name == finetune.name for f in existing):
                raise name_taken(finetune.name)
            _check_count(existing)
            await self.save(finetune)

    async def save(self, finetune: Finetune) -> None:
        await asyncio.to_thread(_write_files, self._dir(finetune), {"record.json": finetune.encode()})

    async def list(self, tenant: str) -> list[Finetune]:
        return await asyncio.to_thread(self._read_all, self.root / tenant_token(tenant))

    @staticmethod
    def _read_all(directory: Path) -> list[Finetune]:
        if not directory.is_dir():
            return []
        found = [Finetune.decode(p.read_bytes()) for p in directory.glob("*/record.json")]
        return sorted(found, key=lambda f: f.created_at)

    async def put_asset(self, finetune: Finetune, file_name: str, data: bytes) -> None:
        await asyncio.to_thread(_write_files, self._dir(finetune), {file_name: data})

    async def asset(self, finetune: Finetune, file_name: str) -> bytes:
        return await asyncio.to_thread((self._dir(finetune) / file_name).read_bytes)

    async def materialize(self, finetune: Finetune, root: Path) -> Path:
        """The finetune's own directory: its files are on this machine already."""
        return self._dir(finetune)


def _check_count(existing: list[Finetune]) -> None:
    if len(existing) >= MAX_FINETUNES_PER_TENANT:
        raise bad_request(f"an account holds at most {MAX_FINETUNES_PER_TENANT} finetunes")


class JetStreamFinetunes(FinetuneStore):
    """The fleet's finetunes: records in the key-value bucket RECORDS_BUCKET, files in the object store
    ASSETS_BUCKET (`<tenant token>/<id>/<file name>`)."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js
        self._records: KeyValue | None = None
        self._assets: ObjectStore | None = None

    async def open(self) -> JetStreamFinetunes:
        from nats.js.api import KeyValueConfig, ObjectStoreConfig, StorageType
        from nats.js.errors import BadRequestError

        try:
            self._records = await self.js.create_key_value(
                KeyValueConfig(bucket=RECORDS_BUCKET, storage=StorageType.FILE, history=1)
            )
        except BadRequestError:  # made by another node or router with other settings: used as it is
            self._records = await self.js.key_value(RECORDS_BUCKET)
        try:
            self._assets = await self.js.create_object_store(
                ASSETS_BUCKET, ObjectStoreConfig(storage=StorageType.FILE)
            )
        except BadRequestError:
            self._assets = await self.js.object_store(ASSETS_BUCKET)
        return self

    @property
    def records(self) -> KeyValue:
        assert self._records is not None, "open() first"
        return self._records

    @property
    def assets(self) -> ObjectStore:
        assert self._assets is not None, "open() first"
        return self._assets

    @staticmethod
    def _key(finetune: Finetune) -> str:
        return f"{tenant_token(finetune.tenant)}.{finetune.name}"

    async def create(self, finetune: Finetune) -> None:
        from nats.js.errors import KeyWrongLastSequenceError

        _check_count(await self.list(finetune.tenant))
        try:
            await self.records.create(self._key(finetune), finetune.encode())
        except KeyWrongLastSequenceError:
            raise name_taken(finetune.name) from None

    async def save(self, finetune: Finetune) -> None:
        await self.records.put(self._key(finetune), finetune.encode())

    async def list(self, tenant: str) -> list[Finetune]:
        # The tenant's keys as the server counts its stream's subjects: no watch over the whole bucket,
        # as nats-py's `keys()` would start.
        prefix = f"$KV.{RECORDS_BUCKET}."
        info = await self.js.stream_info(
            f"KV_{RECORDS_BUCKET}", subjects_filter=f"{prefix}{tenant_token(tenant)}.>"
        )
        keys = [subject.removeprefix(prefix) for subject in info.state.subjects or {}]
        entries = await asyncio.gather(*(self.records.get(key) for key in keys))
        found = [Finetune.decode(e.value) for e in entries if e.value]
        return sorted((f for f in found if f.tenant == tenant), key=lambda f: f.created_at)

    @staticmethod
    def _object(finetune: Finetune, file_name: str) -> str:
        return f"{tenant_token(finetune.tenant)}/{finetune.id}/{file_name}"

    async def put_asset(self, finetune: Finetune, file_name: str, data: bytes) -> None:
        await self.assets.put(self._object(finetune, file_name), data)

    async def asset(self, finetune: Finetune, file_name: str) -> bytes:
        result = await self.assets.get(self._object(finetune, file_name))
        return result.data or b""
