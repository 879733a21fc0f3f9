"""Weighted fair share of prefill work across tenants.

Each tenant with prefill work (a waiting request or a running one still prefilling) has a virtual
service: prefill tokens scheduled for it divided by its weight (tenants file `weight`, default 1). The
scheduler hands the step's token budget and free batch seats to the tenant with the least service
first, so one tenant's burst of long prompts cannot hold the others' first tokens back. A tenant with
nothing to prefill is forgotten; when it comes back it starts level with the least-served tenant (no
credit saved up while idle, which would let it monopolise steps later).
"""

from __future__ import annotations


class FairShare:
    def __init__(self) -> None:
        self.service: dict[str, float] = {}

    def start_step(self, tenants: set[str]) -> None:
        known = [self.service[t] for t in tenants if t in self.service]
        low = min(known, default=0.0)
        self.service = {t: self.service.get(t, low) - low for t in tenants}

    def charge(self, tenant: str, tokens: int, weight: float) -> None:
        self.service[tenant] = self.service.get(tenant, 0.0) + tokens / weight
