"""Tenants' uploaded LoRA adapters (Workers AI's finetunes API), shared by nodes and routers: a finetune is
created for a base model, its two PEFT files are uploaded as assets, and requests then name it by name or id
(`lora`, or `model: "base:name"`). Kept on NATS JetStream for a fleet, in a directory for a lone node."""
