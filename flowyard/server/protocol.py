"""OpenAI-compatible request and response bodies, plus vLLM's and flowyard's extensions.

Requests are validated here (types, ranges) so that the route code only has to check what
needs the engine (model name, context length). Unknown fields are ignored, as vLLM does, so
that clients sending newer OpenAI fields keep working; fields we know but cannot honour are
declared so the server can reject them explicitly instead of silently ignoring them.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


class _Body(BaseModel):
    """Base of request bodies: ignore unknown fields, refuse NaN/inf numbers."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


def _plain_number(v: Any, what: str) -> Any:
    """Refuse JSON booleans and strings where a number is meant: pydantic's lax mode would
    read `true` as 1 and "5" as 5, so a client's type slip would silently become a 1 s SLO
    or a priority instead of a 400."""
    if isinstance(v, (bool, str)):
        raise PydanticCustomError("number_type", "must be {what}, got {v}", {"what": what, "v": json.dumps(v)})
    return v


class StreamOptions(_Body):
    include_usage: bool = False


class SLOSpec(BaseModel):
    """flowyard extension: per-request latency objectives in seconds (see `core.request.SLO`).

    Strict about unknown keys: a typo here would silently drop an objective."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    ttft: float | None = Field(None, gt=0)
    tpot: float | None = Field(None, gt=0)
    tbt: float | None = Field(None, gt=0)

    @field_validator("ttft", "tpot", "tbt", mode="before")
    @classmethod
    def _number(cls, v: Any) -> Any:
        return _plain_number(v, "a positive number of seconds")


class _SamplingRequest(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # None: the served model (OpenAI requires it; vLLM does not)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored
    # vLLM extensions
    top_k: int | None = Field(None, ge=-1)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # flowyard extension: SLOs, flat or as an object (not both)
    ttft_slo: float | None = Field(None, gt=0)
    tpot_slo: float | None = Field(None, gt=0)
    tbt_slo: float | None = Field(None, gt=0)
    slo: SLOSpec | None = None
    # flowyard extension: the conversation a request continues (PLA-Serve's session affinity
    # and re-prefill of its history) and a task tag (DynaServe learns output lengths per task)
    session_id: str | None = Field(None, min_length=1, max_length=256)
    # vLLM's extension: lower runs earlier under `serve --scheduling-policy priority`
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    task: str | None = Field(None, min_length=1, max_length=64)
    # known but unsupported unless left at their neutral value (checked in prepare.py)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("ttft_slo", "tpot_slo", "tbt_slo", mode="before")
    @classmethod
    def _slo_number(cls, v: Any) -> Any:
        return _plain_number(v, "a positive number of seconds")

    @field_validator("priority", mode="before")
    @classmethod
    def _priority_int(cls, v: Any) -> Any:
        return _plain_number(v, "an integer (lower runs earlier)")

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in items):
            raise PydanticCustomError("stop_empty", "stop strings must not be empty")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _ids_nonnegative(cls, v: list[int] | None) -> list[int] | None:
        if v and any(t < 0 for t in v):
            raise PydanticCustomError("token_id", "token ids must be non-negative")
        return v


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, v: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        """Only text content parts can be rendered by a text-only chat template."""
        if isinstance(v, list):
            for part in v:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise PydanticCustomError(
                        "content_part", "only text content parts are supported, got type {t}",
                        {"t": repr(part.get("type"))})
        return v

    def text(self) -> str:
        """The content as one string (text parts joined), '' for None."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p["text"] for p in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int]
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        """Accept a string, a token-id list or a one-element list of either; normalise to
        str | list[int]. Batches of prompts are refused with a clear message (one engine
        request per HTTP request keeps abort-on-disconnect simple)."""

        def is_ids(x: Any) -> bool:
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(v, list) and len(v) == 1 and (isinstance(v[0], str) or isinstance(v[0], list)):
            v = v[0]
        if isinstance(v, str):
            return v
        if isinstance(v, list) and v and is_ids(v):
            if any(t < 0 for t in v):
                raise PydanticCustomError("token_id", "token ids must be non-negative")
            return v
        if isinstance(v, list) and len(v) > 1 and all(isinstance(p, str) or is_ids(p) for p in v):
            raise PydanticCustomError(
                "multiple_prompts", "only one prompt per request is supported, got {n}", {"n": len(v)})
        if isinstance(v, list) and not v:
            raise PydanticCustomError("prompt_empty", "prompt must not be empty")
        raise PydanticCustomError(
            "prompt_type", "prompt must be a string, a list of token ids, or a one-element list of either")


# ---- responses ---------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "flowyard"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
