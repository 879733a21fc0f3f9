"""HTTP plumbing both servers share: request ids, bounded JSON bodies, error handlers and parser errors in
the API's shapes, racing work against a client that leaves."""
