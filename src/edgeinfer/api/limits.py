"""Per-request bounds, the same on nodes and routers so that a malformed body gets the same 4xx from both."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class NodeLimits:
    """Per-request bounds; anything above them is refused with 400 (413 for the body)."""

    max_prompt_tokens: int = 32768
    max_tokens: int = 4096
    max_n: int = 8
    max_top_logprobs: int = 20
    max_stop: int = 16
    max_body_bytes: int = 4 * 1024 * 1024
    max_queue_depth: int = 256
    workers_ai_default_max_tokens: int = 256
    # OpenAI's own limit on inputs per embeddings request.
    max_embedding_inputs: int = 2048
    # Timing hygiene (opt-in): a request served partly from the prefix cache sends its first token no
    # earlier than the next multiple of this many ms after arrival, so its TTFT says less about what was
    # cached. Tenants never share blocks (their own hits are all they can see), so this is for deployments
    # whose tenants hold many users; 0: off.
    ttft_bucket_ms: int = 0

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if getattr(self, name) < (0 if name == "ttft_bucket_ms" else 1):
                raise ValueError(f"limit {name} must be >= {0 if name == 'ttft_bucket_ms' else 1}")
