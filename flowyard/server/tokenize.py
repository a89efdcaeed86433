"""vLLM's `POST /tokenize` and `POST /detokenize`: clients (vLLM's benchmark client among them)
use them to check that a prompt is as long on the server as they meant it to be."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import Field, model_validator

from flowyard.server.errors import APIError
from flowyard.server.protocol import ChatMessage, _Body
from flowyard.server.prepare import check_ids, check_model, encode, read_json


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int] = Field(..., min_length=1)


def tokenize_router() -> APIRouter:
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        st = request.app.state.flowyard
        req = await read_json(request, TokenizeRequest, st.max_body_bytes)
        check_model(req.model, st.served_model_name)
        tok = st.engine.tokenizer
        if req.messages is not None:  # rendered as /v1/chat/completions renders them
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            try:
                text = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
            except Exception as e:
                raise APIError(400, f"could not apply the chat template: {e}", param="messages") from None
            special = bool(req.add_special_tokens)
        else:
            text, special = req.prompt, req.add_special_tokens is not False
        ids = encode(tok, text, special, "messages" if req.messages is not None else "prompt")
        return {"count": len(ids), "max_model_len": st.engine.max_model_len, "tokens": ids}

    @router.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        st = request.app.state.flowyard
        req = await read_json(request, DetokenizeRequest, st.max_body_bytes)
        check_model(req.model, st.served_model_name)
        if any(t < 0 for t in req.tokens):
            raise APIError(400, "token ids must be non-negative", param="tokens")
        check_ids(req.tokens, st.engine, "tokens")
        return {"prompt": st.engine.tokenizer.decode(req.tokens)}

    return router
