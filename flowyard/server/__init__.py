"""OpenAI-compatible HTTP server (FastAPI) in front of any `flowyard.engine.protocol.EngineClient`.

`build_app(engine, api_key=..., served_model_name=...)` returns the ASGI app; run it with
uvicorn. See `app.py` for the routes and `metrics.py` for the Prometheus metric names.
"""

from flowyard.server.app import build_app
from flowyard.server.metrics import ServerMetrics
from flowyard.server.prepare import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_TOKENS

__all__ = ["build_app", "ServerMetrics", "DEFAULT_MAX_TOKENS", "DEFAULT_MAX_BODY_BYTES"]
