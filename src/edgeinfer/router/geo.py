"""Locations and the network between them: one model of round-trip time, by which the router ranks
locations and the fleet simulator times requests, so the simulator that validates the router measures the
network the router assumes. A fleet file's RTT matrix overrides the model for the pairs it lists.

Torch-free and dependency-free.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

EARTH_RADIUS_KM = 6371.0
# Light in silica fibre travels at about two thirds of its speed in vacuum; 2/3 c is the customary figure.
FIBRE_KM_PER_MS = 299_792.458 * (2 / 3) / 1000


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


def haversine_km(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    """Great-circle distance on a spherical Earth."""
    p1, p2 = math.radians(lat1), math.radians(lat2)
    dp, dl = p2 - p1, math.radians(lon2 - lon1)
    h = math.sin(dp / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(dl / 2) ** 2
    return 2 * EARTH_RADIUS_KM * math.asin(min(1.0, math.sqrt(h)))


def great_circle_km(a: Location, b: Location) -> float:
    return haversine_km(a.lat, a.lon, b.lat, b.lon)


@dataclass(frozen=True, kw_only=True)
class NetworkModel:
    """RTT = 2 × great-circle distance / fibre speed × `path_inflation` + `last_mile_ms`.

    Routed paths run about twice the great circle in fibre time, and every round trip crosses a client's
    access network once; docs/fleet.md gives the sources of both defaults.
    """

    path_inflation: float = 2.0
    last_mile_ms: float = 5.0

    def rtt_s_from_km(self, km: float) -> float:
        """Seconds of a round trip between points `km` apart (a numpy array of distances works as well)."""
        return (2 * km / FIBRE_KM_PER_MS * self.path_inflation + self.last_mile_ms) / 1000

    def rtt_s(self, a: Location, b: Location) -> float:
        return self.rtt_s_from_km(great_circle_km(a, b))

    def rtt_ms(self, a: Location, b: Location) -> float:
        return self.rtt_s(a, b) * 1000


class RttTable:
    """`rtt(a, b)` in seconds between location codes; symmetric; matrix entries override the model."""

    def __init__(
        self,
        locations: Iterable[Location],
        matrix: Mapping[tuple[str, str], float] | None = None,
        network: NetworkModel | None = None,
    ) -> None:
        self.network = network or NetworkModel()
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
        self._known: dict[tuple[str, str], float] = {}  # every pair asked so far: the policy asks per request

    def __contains__(self, code: object) -> bool:
        return code in self.locations

    def __call__(self, a: str, b: str) -> float:
        return self.rtt(a, b)

    def rtt(self, a: str, b: str) -> float:
        """KeyError for an unknown code."""
        known = self._known.get((a, b))
        if known is not None:
            return known
        configured = self._matrix.get(frozenset((a, b)))
        if configured is None:
            configured = self.network.rtt_s(self.locations[a], self.locations[b])
        self._known[(a, b)] = configured
        return configured

    def nearest_first(self, origin: str) -> list[str]:
        """Every location code, nearest to `origin` first (ties by code, so the order is stable)."""
        return sorted(self.locations, key=lambda code: (self.rtt(origin, code), code))
