"""Backends run jobs on a leased pool member: a local engine, an upstream server, an embedding model."""
