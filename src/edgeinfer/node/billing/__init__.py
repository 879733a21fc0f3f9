"""Node-local accounting: admission (rate limits, per-model capacity), prices and the usage store."""
