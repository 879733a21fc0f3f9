"""LoRA adapters (PEFT's format) on a served dense model: checked at registration, kept under a memory
budget, and applied per token in mixed batches beside the base's own products."""

from edgeinfer.engine.lora.config import MAX_RANK, AdapterConfig, AdapterError
from edgeinfer.engine.lora.registry import AdapterRegistry, UnknownAdapterError

__all__ = ["MAX_RANK", "AdapterConfig", "AdapterError", "AdapterRegistry", "UnknownAdapterError"]
