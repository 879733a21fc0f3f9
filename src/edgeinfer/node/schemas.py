"""Request bodies of the OpenAI and Workers-AI APIs (responses are built as plain dicts in render_*).

Unknown fields are ignored, as OpenAI-compatible servers do; fields we cannot honour (tools, non-text
response formats, logit_bias, suffix) are refused with 400 rather than silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class RequestOptions(_Body):
    """Workers-AI request options (also accepted at the top level of OpenAI bodies)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    reject_if_busy: bool = Field(False, alias="rejectIfBusy")


class SamplingFields(_Body):
    """Sampling fields shared by completions and chat, including vLLM/SGLang extras."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=10.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    n: int = Field(1, ge=1)
    best_of: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    options: RequestOptions | None = None


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)
    suffix: str | None = None


class TextPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


class EmbeddingRequest(_Body):
    """POST /v1/embeddings."""

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    options: RequestOptions | None = None


class WorkersAIRunRequest(_Body):
    """POST /accounts/{account_id}/ai/run/{model}: text generation with `prompt` or `messages`, or text
    embeddings with `text` (which one the model decides)."""

    text: str | list[str] | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    raw: bool = False
    stream: bool = False
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=10.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = None
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    options: RequestOptions | None = None
