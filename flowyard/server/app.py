"""The OpenAI-compatible FastAPI app in front of an `EngineClient`.

Routes: POST /v1/chat/completions, POST /v1/completions (stream or not), GET /v1/models,
GET /health, GET /metrics. The app holds no engine logic: it validates, calls
`engine.generate`, relays outputs, and makes sure the engine hears about clients that leave.

For a streaming request the handler waits for the engine's first output before sending the
headers: an engine that refuses the request (queue full) can then still get a 503 instead
of a 200 followed by an error event. A client that hangs up during that wait, or during a
non-streaming request, is noticed by `until_disconnect` and its request aborted.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from flowyard.engine.protocol import EngineClient
from flowyard.server.dashboard import dashboard_router
from flowyard.server.tokenize import tokenize_router
from flowyard.server.errors import APIError, install_error_handlers, server_error
from flowyard.server.metrics import ServerMetrics
from flowyard.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from flowyard.server.prepare import (DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_TOKENS, Prepared, prepare_chat,
                                     prepare_completion, read_json, with_slo_headers)
from flowyard.server.serving import Generation, until_disconnect
from flowyard.server.streaming import SSEResponse, collect, full_response, sse_events

log = logging.getLogger("flowyard.server")

#: Status for a request whose client left before the answer (nginx's convention; never seen
#: by the client, only by access logs).
CLIENT_CLOSED = 499


@dataclass(slots=True)
class ServerState:
    engine: EngineClient
    metrics: ServerMetrics
    served_model_name: str
    max_body_bytes: int
    default_max_tokens: int
    started: int


def _state(request: Request) -> ServerState:
    return request.app.state.flowyard


class APIKeyMiddleware:
    """Pure ASGI middleware (BaseHTTPMiddleware would break streaming disconnect detection):
    every /v1 path needs `Authorization: Bearer <api_key>`; /health and /metrics stay open
    for probes and scrapers."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope.get("headers") or []).get(b"authorization")
            if given is None or not secrets.compare_digest(given, self.expected):
                msg = "Missing API key: send 'Authorization: Bearer <key>'" if given is None else "Incorrect API key provided"
                err = APIError(401, msg, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _serve(request: Request, kind: str, p: Prepared, arrival: float) -> Response:
    st = _state(request)
    gen = Generation(st.engine, st.metrics, p, arrival)
    handed_off = False
    try:
        gen.start()
        headers = {"X-Request-Id": p.request_id}
        if p.stream:
            gone, first = await until_disconnect(request, gen.next)
            if gone:
                return Response(status_code=CLIENT_CLOSED)
            handed_off = True  # from here SSEResponse owns gen.close()
            return SSEResponse(sse_events(kind, gen, first), on_close=gen.close, headers=headers)

        async def run() -> dict:
            return full_response(kind, gen, await collect(gen, await gen.next(), kind))

        gone, body = await until_disconnect(request, run)
        if gone:
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(body, headers=headers)
    except APIError:
        raise
    except Exception as e:  # engine bug: answer JSON 500, keep serving
        log.exception("engine failed on %s", p.request_id)
        gen.failed()
        raise server_error(e) from None
    finally:
        if not handed_off:
            await gen.close()


def build_router() -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.perf_counter()
        st = _state(request)
        req = await read_json(request, ChatCompletionRequest, st.max_body_bytes)
        p = with_slo_headers(prepare_chat(req, st.engine, st.served_model_name, st.default_max_tokens),
                             request.headers)
        return await _serve(request, "chat", p, arrival)

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.perf_counter()
        st = _state(request)
        req = await read_json(request, CompletionRequest, st.max_body_bytes)
        p = with_slo_headers(prepare_completion(req, st.engine, st.served_model_name, st.default_max_tokens),
                             request.headers)
        return await _serve(request, "cmpl", p, arrival)

    @router.get("/v1/models")
    async def models(request: Request) -> ModelList:
        st = _state(request)
        card = ModelCard(id=st.served_model_name, created=st.started, root=st.engine.model_name,
                         max_model_len=st.engine.max_model_len)
        return ModelList(data=[card])

    @router.get("/health")
    async def health(request: Request) -> JSONResponse:
        try:
            stats = _state(request).engine.stats()
        except Exception as e:
            log.exception("engine.stats() failed in /health")
            return APIError(503, f"engine stats unavailable: {e}", code="engine_unavailable").response()
        # 503 (with Retry-After) when no instance can take work: a load balancer stops sending
        body = dataclasses.asdict(stats)
        if stats.healthy:
            return JSONResponse(body)
        return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router


def build_app(engine: EngineClient, *, api_key: str | None = None, served_model_name: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> FastAPI:
    """Build the server app for `engine`.

    api_key: when set, /v1/* requires `Authorization: Bearer <api_key>`.
    served_model_name: the name clients must use in `model` (default `engine.model_name`).
    max_body_bytes: larger request bodies get 413. default_max_tokens: cap on the output
    length of requests that give no max_tokens (they otherwise fill the context window).
    """
    name = served_model_name or engine.model_name
    app = FastAPI(title="flowyard", summary="OpenAI-compatible LLM server", docs_url=None, redoc_url=None)
    app.state.flowyard = ServerState(engine, ServerMetrics(engine, name), name, max_body_bytes,
                                     default_max_tokens, int(time.time()))
    install_error_handlers(app)
    app.include_router(build_router())
    app.include_router(dashboard_router())
    app.include_router(tokenize_router())
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return app
