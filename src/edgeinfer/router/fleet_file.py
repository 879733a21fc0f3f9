"""The fleet file (`--fleet fleet.toml`): locations, the nodes in each, an optional RTT matrix.

    [[locations]]
    code = "FRA"
    lat = 50.03
    lon = 8.57
    [[locations.nodes]]
    id = "fra-1"                      # the node's --node-id
    url = "http://10.0.0.5:8000"

    [rtt_ms]                          # optional; pairs not listed come from great-circle distance
    "FRA-AMS" = 9.0

The file is the authority on which nodes exist and where they are: a status from a node id the file
does not name is ignored, so a stray publisher on the bus cannot draw traffic.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeinfer.router.geo import Location, RttTable


@dataclass(frozen=True)
class NodeEntry:
    node_id: str
    location: str
    url: str


@dataclass(frozen=True)
class Fleet:
    locations: tuple[Location, ...]
    nodes: tuple[NodeEntry, ...]
    rtt: RttTable

    def node(self, node_id: str) -> NodeEntry:
        for entry in self.nodes:
            if entry.node_id == node_id:
                return entry
        raise KeyError(node_id)


def load_fleet(path: str | Path) -> Fleet:
    import tomllib

    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read fleet file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"fleet file {path} is not valid TOML: {exc}") from None
    return parse_fleet(data)


def parse_fleet(data: dict[str, Any]) -> Fleet:
    entries = data.get("locations")
    if not isinstance(entries, list) or not entries:
        raise ValueError("fleet file: needs a non-empty [[locations]] list")
    locations: list[Location] = []
    nodes: list[NodeEntry] = []
    for i, entry in enumerate(entries):
        location, members = _parse_location(entry, i)
        locations.append(location)
        nodes.extend(members)
    ids = [n.node_id for n in nodes]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ValueError(f"fleet file: node id(s) listed twice: {', '.join(duplicates)}")
    matrix = {_pair(key): _ms(value, key) / 1000.0 for key, value in dict(data.get("rtt_ms", {})).items()}
    return Fleet(tuple(locations), tuple(nodes), RttTable(locations, matrix))


def _parse_location(entry: Any, index: int) -> tuple[Location, list[NodeEntry]]:
    where = f"locations[{index}]"
    if not isinstance(entry, dict):
        raise ValueError(f"fleet file: {where} must be a table")
    try:
        location = Location(str(entry["code"]), float(entry["lat"]), float(entry["lon"]))
    except KeyError as exc:
        raise ValueError(f"fleet file: {where} needs {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"fleet file: {where}: {exc}") from None
    nodes = []
    for j, node in enumerate(entry.get("nodes", [])):
        if (
            not isinstance(node, dict)
            or not node.get("id")
            or not str(node.get("url", "")).startswith("http")
        ):
            raise ValueError(f"fleet file: {where}.nodes[{j}] needs an `id` and an http(s) `url`")
        nodes.append(NodeEntry(str(node["id"]), location.code, str(node["url"]).rstrip("/")))
    return location, nodes


def _pair(key: str) -> tuple[str, str]:
    a, sep, b = key.partition("-")
    if not sep or not a or not b:
        raise ValueError(f'fleet file: rtt_ms key {key!r} must look like "FRA-AMS"')
    return a, b


def _ms(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"fleet file: rtt_ms.{key} must be a number of milliseconds >= 0")
    return float(value)
