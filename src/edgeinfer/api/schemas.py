"""Request bodies of the OpenAI and Workers-AI APIs (responses are built as plain dicts in render_*).

Unknown fields are ignored, as OpenAI-compatible servers do; fields we cannot honour (logit_bias, suffix,
non-text content parts) are refused with 400 rather than silently dropped. Types are strict
(`true` is not an integer, `"1"` not a number), and text must be valid Unicode (no lone surrogates, which
JSON's `\\ud800` escapes can carry): such bodies get 400 before anything else reads them. An integer is
what JSON Schema (and so /openapi.json) calls one: a number without a fractional part, `8.0` as well as
`8` (`Int`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from edgeinfer.types.validation import SAMPLING_BOUNDS, TOKEN_ID, InvalidInput


def _integral(value: Any) -> Any:
    """A float with no fractional part as the int it equals (JSON Schema's `integer` includes 10241761.0);
    any other value goes on to the strict int check, which refuses other floats and booleans."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# The bounds come before the float conversion: on the int itself they are checked exactly (as ints: a
# bound applied outside it compares as floats, and 2**64 + 1 passed `le=2**64 - 1`) and appear in the schema
# as `minimum` / `maximum`.
_INTEGRAL = BeforeValidator(_integral)
Int = Annotated[int, _INTEGRAL]
Count = Annotated[int, Field(ge=1), _INTEGRAL]
NonNegative = Annotated[int, Field(ge=0), _INTEGRAL]
# vLLM's `priority`: lower runs first (with --scheduling-policy priority); the tenant's range bounds it
Priority = Annotated[int, Field(ge=-(2**31), le=2**31 - 1), _INTEGRAL]


def _sampling_bound(name: str) -> Any:
    """The bound of sampling field `name` (types/validation.py), in the schema as minimum / maximum and
    checked with the message SamplingParams gives (a 400 here, before anything else reads the body)."""
    bound = SAMPLING_BOUNDS[name]

    def check(value: Any) -> Any:
        if value is not None and not bound.admits(value):
            raise InvalidInput(bound.message(name), name)
        return value

    return Field(json_schema_extra=bound.json_schema()), AfterValidator(check)


def _bounded_float(name: str) -> Any:
    return Annotated[float, *_sampling_bound(name)]


def _bounded_int(name: str) -> Any:
    return Annotated[int, *_sampling_bound(name), _INTEGRAL]


def _token_id(field: str) -> Any:
    """One token id of list field `field`, within TOKEN_ID (checked as the sampling bounds are)."""

    def check(value: int) -> int:
        if not TOKEN_ID.admits(value):
            raise InvalidInput(TOKEN_ID.message(f"every id in {field}"), field)
        return value

    return Annotated[int, Field(json_schema_extra=TOKEN_ID.json_schema()), AfterValidator(check), _INTEGRAL]


StopTokenId = _token_id("stop_token_ids")
MaxTokens = _bounded_int("max_tokens")
TopK = _bounded_int("top_k")
Seed = _bounded_int("seed")
MinTokens = _bounded_int("min_tokens")
Temperature = _bounded_float("temperature")
TopP = _bounded_float("top_p")
MinP = _bounded_float("min_p")
RepetitionPenalty = _bounded_float("repetition_penalty")
PresencePenalty = _bounded_float("presence_penalty")
FrequencyPenalty = _bounded_float("frequency_penalty")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class _RequestBody(_Body):
    """A whole request body: its text, at any depth, must encode as UTF-8."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        if _has_lone_surrogate(data):
            raise ValueError("the body holds text that is not valid Unicode (a lone surrogate)")
        return data


def _has_lone_surrogate(value: Any) -> bool:
    """Whether any string (key or value) in `value` fails to encode as UTF-8; a walk without recursion,
    so that no nesting can overflow the stack (types/bounded_json.py bounds that of parsed bodies too)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return False


class StreamOptions(_Body):
    include_usage: bool = False


class RequestOptions(_Body):
    """Workers-AI request options (also accepted at the top level of OpenAI bodies)."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    reject_if_busy: bool = Field(False, alias="rejectIfBusy")


class SamplingFields(_RequestBody):
    """Sampling fields shared by completions and chat, including vLLM/SGLang extras."""

    model: str
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    n: Count = 1
    best_of: Count | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StopTokenId] | None = None
    seed: Seed | None = None
    presence_penalty: PresencePenalty | None = None
    frequency_penalty: FrequencyPenalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    ignore_eos: bool = False
    min_tokens: MinTokens = 0
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    options: RequestOptions | None = None
    priority: Priority = 0
    # edgeinfer's own: false keeps this request out of speculative decoding where the server runs it
    # (its output is the same either way; a caller measuring plain decode, or with little to copy, opts out)
    speculative: bool = True


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[Int] | list[list[Int]]
    echo: bool = False
    logprobs: NonNegative | None = None
    suffix: str | None = None
    response_format: dict[str, Any] | None = None


class TextPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: NonNegative | None = None
    max_completion_tokens: Count | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class EmbeddingRequest(_RequestBody):
    """POST /v1/embeddings."""

    model: str
    input: str | list[str] | list[Int] | list[list[Int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Count | None = None
    user: str | None = None
    options: RequestOptions | None = None


class WorkersAIRunRequest(_RequestBody):
    """POST /accounts/{account_id}/ai/run/{model}: text generation with `prompt` or `messages`, or text
    embeddings with `text` (which one the model decides)."""

    # Exactly one of the three, not null (a null field counts as absent).
    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [
                {"required": [name], "properties": {name: schema}}
                for name, schema in (
                    ("prompt", {"type": "string"}),
                    ("messages", {"type": "array"}),
                    ("text", {"type": ["string", "array"]}),
                )
            ]
        }
    )

    text: str | list[str] | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    raw: bool = False
    stream: bool = False
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    repetition_penalty: RepetitionPenalty | None = None
    frequency_penalty: FrequencyPenalty | None = None
    presence_penalty: PresencePenalty | None = None
    response_format: dict[str, Any] | None = None
    lora: str | None = Field(None, description="one of the calling tenant's LoRA adapters of this model")
    options: RequestOptions | None = None
