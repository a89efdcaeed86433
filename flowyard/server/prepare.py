"""From a validated HTTP body to one engine request.

`prepare_*` turns a body into token ids, `SamplingParams` and an `SLO`, raising `APIError`
for anything the engine would choke on, so that bad input is a 4xx and never reaches the
engine (`serving.Generation` then owns the request's lifetime).
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from flowyard.core.request import SLO
from flowyard.engine.protocol import EngineClient
from flowyard.engine.sampling import MAX_LOGPROBS, SamplingParams
from flowyard.server.errors import APIError, validation_error
from flowyard.server.jsoncheck import check_json, parse_json
from flowyard.server.protocol import ChatCompletionRequest, CompletionRequest, _SamplingRequest

#: max_tokens when the request gives none: fill the context, but at most this many.
DEFAULT_MAX_TOKENS = 256
#: Request bodies above this are refused with 413 before being parsed.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024

M = TypeVar("M", bound=BaseModel)


@dataclass(slots=True)
class Prepared:
    """Everything needed to run and answer one request."""

    request_id: str
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    slo: SLO | None
    stream: bool
    include_usage: bool
    created: int
    session: str | None = None
    task: str | None = None
    priority: int = 0

    @property
    def routing(self) -> dict:
        """What the global scheduler learns besides the prompt (only what the client gave)."""
        out: dict[str, str | int] = {k: v for k, v in (("session", self.session), ("task", self.task))
                                     if v is not None}
        if self.priority:
            out["priority"] = self.priority
        return out


async def read_json(request: Request, model: type[M], max_bytes: int) -> M:
    """Read the body (413 past `max_bytes`, counted while reading so a lying or absent
    Content-Length cannot get around it), parse JSON (400), refuse strings that are not
    Unicode text and too deep nesting (400, `jsoncheck`) and validate it (400)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {max_bytes} bytes",
                       code="request_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise APIError(413, f"request body exceeds the limit of {max_bytes} bytes", code="request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:  # nobody will read the answer; just don't log it as a crash
        raise APIError(400, "client disconnected while sending the request body") from None
    data = parse_json(b"".join(chunks))
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    check_json(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def _reject_unsupported(req: _SamplingRequest) -> None:
    """Refuse options we would otherwise silently ignore (a wrong answer is worse than a 400)."""
    checks: list[tuple[str, bool]] = [
        ("n", req.n != 1),
        ("best_of", req.best_of not in (None, 1)),
        ("presence_penalty", req.presence_penalty not in (None, 0)),
        ("frequency_penalty", req.frequency_penalty not in (None, 0)),
        ("repetition_penalty", req.repetition_penalty not in (None, 1)),
        ("logit_bias", bool(req.logit_bias)),
        ("response_format", req.response_format is not None and req.response_format.get("type") != "text"),
    ]
    if isinstance(req, ChatCompletionRequest):
        checks += [("tools", bool(req.tools))]
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
    if isinstance(req, CompletionRequest):
        checks += [("echo", bool(req.echo)), ("suffix", bool(req.suffix))]
    n = requested_logprobs(req)
    if n is not None and not 0 <= n <= MAX_LOGPROBS:
        param = "top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs"
        raise APIError(400, f"{param} must be in [0, {MAX_LOGPROBS}], got {n}", param=param, code="invalid_value")
    for name, bad in checks:
        if bad:
            what = "n > 1" if name == "n" else f"'{name}'"
            raise APIError(400, f"{what} is not supported by this server", param=name, code="unsupported_parameter")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options can only be given when stream is true", param="stream_options")


def requested_logprobs(req: _SamplingRequest) -> int | None:
    """How many top log-probabilities per token the request asks for (None: none)."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return getattr(req, "logprobs", None)


def check_model(requested: str | None, served: str) -> str:
    if requested is not None and requested != served:
        raise APIError(404, f"The model '{requested}' does not exist (this server serves '{served}')",
                       param="model", code="model_not_found")
    return served


SLO_HEADERS = {"x-slo-ttft-ms": "ttft", "x-slo-tpot-ms": "tpot", "x-slo-tbt-ms": "tbt"}


def with_slo_headers(p: Prepared, headers) -> Prepared:
    """Per-request SLOs from `x-slo-ttft-ms` / `x-slo-tpot-ms` / `x-slo-tbt-ms` headers
    (milliseconds), merged with the body's; a bad value, or a header that contradicts the
    body, is a 400."""
    given = {}
    for name, field in SLO_HEADERS.items():
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            ms = float(raw)
        except ValueError:
            ms = math.nan
        if not (math.isfinite(ms) and ms > 0):
            raise APIError(400, f"header {name} must be a positive number of milliseconds, got {raw!r}",
                           param=name, code="invalid_value")
        given[field] = ms / 1e3
    if not given:
        return p
    body = p.slo or SLO()
    for name, field in SLO_HEADERS.items():
        old, v = getattr(body, field), given.get(field)
        if old is not None and v is not None and abs(old - v) > 1e-9:
            raise APIError(400, f"{field}_slo is {old:g} s in the body but header {name} says {v * 1e3:g} ms; "
                                "give one", param=field + "_slo", code="invalid_value")
    return dataclasses.replace(p, slo=dataclasses.replace(body, **given))


def _slo(req: _SamplingRequest) -> SLO | None:
    flat = {k: getattr(req, f"{k}_slo") for k in ("ttft", "tpot", "tbt")}
    if req.slo is not None and any(v is not None for v in flat.values()):
        raise APIError(400, "give either 'slo' or 'ttft_slo'/'tpot_slo'/'tbt_slo', not both", param="slo")
    fields = req.slo.model_dump() if req.slo is not None else flat
    slo = SLO(**fields)
    return None if slo.empty else slo


def encode(tokenizer, text: str, special: bool, param: str) -> list[int]:
    """Tokenize client text; whatever the tokenizer refuses is the client's input (a 400)."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=special))
    except Exception as e:  # noqa: BLE001 - e.g. the Rust tokenizer's TypeError on odd text
        raise APIError(400, f"could not tokenize {param}: {type(e).__name__}: {e}", param=param) from None


def check_ids(ids: list[int], engine: EngineClient, param: str) -> None:
    vocab = getattr(engine.tokenizer, "vocab_size", None)
    if isinstance(vocab, int) and any(t >= vocab for t in ids):
        raise APIError(400, f"token ids must be below the vocabulary size {vocab}", param=param)


def _sampling(req: _SamplingRequest, max_tokens: int | None, max_tokens_param: str,
              prompt_len: int, max_model_len: int, default_max_tokens: int, prompt_param: str) -> SamplingParams:
    room = max_model_len - prompt_len
    if room < 1:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens, but the prompt "
                            f"has {prompt_len} tokens (no room for any output)",
                       param=prompt_param, code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(default_max_tokens, room)
    elif max_tokens > room:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                            f"{prompt_len} tokens and {max_tokens_param}={max_tokens} asks for {max_tokens} "
                            f"more (at most {room} allowed)",
                       param=max_tokens_param, code="context_length_exceeded")
    if req.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens={req.min_tokens} exceeds max_tokens={max_tokens}", param="min_tokens",
                       code="invalid_value")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k in (None, 0) else req.top_k,
            min_tokens=req.min_tokens, seed=req.seed, stop=stop,
            stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
            logprobs=requested_logprobs(req))
    except ValueError as e:
        raise APIError(400, str(e), code="invalid_value") from None


def _finish(req: _SamplingRequest, kind: str, served: str, prompt_ids: list[int], max_tokens: int | None,
            max_tokens_param: str, engine: EngineClient, default_max_tokens: int, prompt_param: str) -> Prepared:
    params = _sampling(req, max_tokens, max_tokens_param, len(prompt_ids), engine.max_model_len,
                       default_max_tokens, prompt_param)
    include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
    return Prepared(f"{kind}-{uuid.uuid4().hex}", served, prompt_ids, params, _slo(req), req.stream,
                    include_usage, int(time.time()), req.session_id, req.task, req.priority)


def prepare_chat(req: ChatCompletionRequest, engine: EngineClient, served: str,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS) -> Prepared:
    """Render the messages with the tokenizer's chat template, then tokenize without adding
    special tokens (the template already has them)."""
    _reject_unsupported(req)
    model = check_model(req.model, served)
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as e:  # templates raise on e.g. unsupported role orders
        raise APIError(400, f"could not apply the chat template: {e}", param="messages") from None
    ids = encode(engine.tokenizer, text, False, "messages")
    if not ids:
        raise APIError(400, "messages render to an empty prompt", param="messages")
    mt: int | None
    if req.max_completion_tokens is not None:
        mt, mt_param = req.max_completion_tokens, "max_completion_tokens"
    else:
        mt, mt_param = req.max_tokens, "max_tokens"
    return _finish(req, "chatcmpl", model, ids, mt, mt_param, engine, default_max_tokens, "messages")


def prepare_completion(req: CompletionRequest, engine: EngineClient, served: str,
                       default_max_tokens: int = DEFAULT_MAX_TOKENS) -> Prepared:
    """A string prompt is tokenized with special tokens (BOS), like vLLM; token ids are used as given."""
    _reject_unsupported(req)
    model = check_model(req.model, served)
    if isinstance(req.prompt, str):
        ids = encode(engine.tokenizer, req.prompt, True, "prompt")
    else:
        ids = list(req.prompt)
        check_ids(ids, engine, "prompt")
    if not ids:
        raise APIError(400, "prompt must not be empty", param="prompt")
    return _finish(req, "cmpl", model, ids, req.max_tokens, "max_tokens", engine, default_max_tokens, "prompt")
