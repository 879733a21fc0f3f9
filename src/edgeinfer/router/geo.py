"""Locations and the round-trip times between them: a configured matrix, else great-circle distance.

Torch-free and dependency-free, so the fleet simulator can use it as the router does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

EARTH_RADIUS_KM = 6371.0
# Light in fibre covers ~200 km per ms one way; real routes are ~1.5x the great circle (detours, hops).
FIBRE_KM_PER_S = 200_000.0
ROUTE_FACTOR = 1.5
# Even a client in the same metro pays a switch and a last mile.
MIN_RTT_S = 0.001


@dataclass(frozen=True)
class Location:
    """A site close to users: an IATA-like code (FRA, AMS) and its coordinates in degrees."""

    code: str
    lat: float
    lon: float

    def __post_init__(self) -> None:
        if not self.code:
            raise ValueError("a location needs a code")
        if not (-90.0 <= self.lat <= 90.0 and -180.0 <= self.lon <= 180.0):
            raise ValueError(f"location {self.code}: lat must be in [-90, 90] and lon in [-180, 180]")


def great_circle_km(a: Location, b: Location) -> float:
    """Haversine distance."""
    phi1, phi2 = math.radians(a.lat), math.radians(b.lat)
    dphi, dlmb = phi2 - phi1, math.radians(b.lon - a.lon)
    h = math.sin(dphi / 2) ** 2 + math.cos(phi1) * math.cos(phi2) * math.sin(dlmb / 2) ** 2
    return 2 * EARTH_RADIUS_KM * math.asin(min(1.0, math.sqrt(h)))


def rtt_from_distance(km: float) -> float:
    """Seconds for a round trip over fibre along a route ROUTE_FACTOR times the great circle."""
    return MIN_RTT_S + 2.0 * km * ROUTE_FACTOR / FIBRE_KM_PER_S


class RttTable:
    """`rtt(a, b)` in seconds between location codes; symmetric; matrix entries override geometry."""

    def __init__(
        self, locations: Iterable[Location], matrix: Mapping[tuple[str, str], float] | None = None
    ) -> None:
        self.locations: dict[str, Location] = {}
        for loc in locations:
            if loc.code in self.locations:
                raise ValueError(f"location {loc.code} is listed twice")
            self.locations[loc.code] = loc
        self._matrix: dict[frozenset[str], float] = {}
        for (a, b), seconds in (matrix or {}).items():
            for code in (a, b):
                if code not in self.locations:
                    raise ValueError(f"RTT matrix names unknown location {code!r}")
            if seconds < 0:
                raise ValueError(f"RTT {a}-{b} must be >= 0")
            self._matrix[frozenset((a, b))] = float(seconds)

    def __contains__(self, code: object) -> bool:
        return code in self.locations

    def __call__(self, a: str, b: str) -> float:
        return self.rtt(a, b)

    def rtt(self, a: str, b: str) -> float:
        """KeyError for an unknown code."""
        configured = self._matrix.get(frozenset((a, b)))
        if configured is not None:
            return configured
        here, there = self.locations[a], self.locations[b]
        if a == b:
            return MIN_RTT_S
        return rtt_from_distance(great_circle_km(here, there))

    def nearest_first(self, origin: str) -> list[str]:
        """Every location code, nearest to `origin` first (ties by code, so the order is stable)."""
        return sorted(self.locations, key=lambda code: (self.rtt(origin, code), code))
