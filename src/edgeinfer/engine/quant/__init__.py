"""engine/quant room."""
