"""node room: the node server. `service.py` is the request pipeline; `http/` its app and routes,
`backends/` what runs a job on a pool member, `billing/` admission, prices and metering."""
