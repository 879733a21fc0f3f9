"""api room: what the node and the router both speak — request schemas and their validation into jobs,
error envelopes, tenants and keys, router↔node trust. Torch-free; imports `types` and, for the tool and
response_format checks every server makes at its edge, `structured` (never `node`, `router`, `engine`,
`pool`)."""
