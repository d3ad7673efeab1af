"""The server's routes: OpenAI's, the Responses API's, Anthropic's and Ollama's, on one app."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route

from . import anthropic, ollama, openai_api, responses
from .api import error_response
from .app import Server


def create_app(server: Server) -> Starlette:
    """The starlette app of ``server``; its scheduler's worker runs while the app does."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        server.scheduler.start()
        try:
            yield
        finally:
            server.scheduler.stop()

    async def not_found(request: Request, exc):
        return error_response(f"no route {request.method} {request.url.path}", exc.status_code)

    return Starlette(routes=[
        Route("/health", server.health, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        *openai_api.routes(server), *responses.routes(server), *anthropic.routes(server), *ollama.routes(server),
    ], lifespan=lifespan, exception_handlers={404: not_found, 405: not_found})
