"""ledger room: `edgeinfer ledger`, the fleet's one record of usage. A durable JetStream consumer stores every
node's usage events once (`store.py`: SQLite or PostgreSQL) and answers usage queries over NATS (`client.py`
is the asking side, for routers). Imports `api` and `types` of ours, never a server, the engine or torch."""
