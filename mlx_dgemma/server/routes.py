"""The server's routes: OpenAI's, the Responses API's, Anthropic's, Ollama's, the embeddings' and vLLM's
tokenizer's, on one app, each answering browsers of the allowed origins (CORS: a preflight ``OPTIONS`` and the
headers on every reply; origins.py refuses every other origin)."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.routing import Route

from . import anthropic, embeddings, ollama, openai_api, request_log, responses, tokenize
from .api import error_response
from .app import Server
from .origins import LOCAL_ORIGIN, LocalGuard

ALLOWED_ORIGINS = ()  # Ollama's default: pages of local origins alone may call the server


def error_in_api_shape(path: str, message: str, status: int):
    """A refusal in the error shape of the API ``path`` belongs to."""
    if path.startswith("/api/"):
        return ollama.ollama_error(message, status)
    if path.startswith("/v1/messages"):
        return anthropic.anthropic_error(message, status)
    return error_response(message, status)


def create_app(server: Server, allowed_origins=ALLOWED_ORIGINS, bind_host: str = "127.0.0.1") -> Starlette:
    """The starlette app of ``server``; its scheduler's worker runs while the app does. A browser page of
    a local origin, or one in ``allowed_origins`` (``"*"``: any), may call every route; any other origin,
    and on a loopback ``bind_host`` any ``Host`` that is not local, gets a 403 (origins.py)."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        server.scheduler.start()
        try:
            yield
        finally:
            server.scheduler.stop()

    async def not_found(request: Request, exc):
        """A path or method no route takes, in the error shape of the API the path belongs to."""
        path, status = request.url.path, exc.status_code
        allowed = (exc.headers or {}).get("Allow") if status == 405 else None
        message = (
            f"{path} does not take {request.method}; send {allowed}" if allowed else f"no route {request.method} {path}"
        )
        return error_in_api_shape(path, message, status)

    def refuse(path: str, message: str):
        request_log.log.info("%s refused with 403: %s", path, message)
        return error_in_api_shape(path, message, 403)

    return Starlette(
        routes=[
            Route("/health", server.health, methods=["GET"]),
            Route("/v1/models", server.models, methods=["GET"]),
            Route("/v1/models/{model:path}", server.retrieve_model, methods=["GET"]),
            *openai_api.routes(server),
            *responses.routes(server),
            *anthropic.routes(server),
            *ollama.routes(server),
            *embeddings.routes(server),
            *tokenize.routes(server),
        ],
        lifespan=lifespan,
        exception_handlers={404: not_found, 405: not_found},
        middleware=[
            Middleware(LocalGuard, allowed_origins=allowed_origins, bind_host=bind_host, refuse=refuse),
            Middleware(
                CORSMiddleware,
                allow_origins=list(allowed_origins),
                allow_origin_regex=LOCAL_ORIGIN,
                allow_methods=["*"],
                allow_headers=["*"],
            ),
        ],
    )
