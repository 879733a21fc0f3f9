"""The Batch API's queue (Workers AI's `queueRequest=true`), shared by nodes and routers: work on a JetStream
work-queue stream, results in a key-value bucket that keeps them for a retention time (docs/server.md)."""
