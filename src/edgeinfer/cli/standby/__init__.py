"""A standby process that forks `edgeinfer serve` (and `generate`, `embed`) with torch and the engine
already imported: `server.py` is the `edgeinfer standby` command, `child.py` what a forked child does,
`client.py` what `edgeinfer serve` runs first, `wire.py` what the two sides share."""
