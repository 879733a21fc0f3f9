"""Fleet-wide tenant limits, enforced at the routers on NATS JetStream (docs/router.md, "Fleet limits").

Each tenant's budget lives in a JetStream key-value bucket (store.py): a counter per limit and fixed time
window, and a table of concurrency slots held per router. A router leases a slice of a budget at a time
(leases.py) and admits from its slice locally, so most decisions cost no round trip; what it does not use
goes back to the bucket once it sits idle. Every change to the bucket is a compare-and-set, so the routers
together never hand out more than the limit per window. `FleetLimiter` (limiter.py) is what the router's
request path calls.
"""
