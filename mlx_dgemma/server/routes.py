"""The server's routes: OpenAI's (app.py), the Responses API's, Anthropic's and Ollama's, on one app."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route

from . import anthropic, ollama, responses
from .app import Server, error_response


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
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        *responses.routes(server), *anthropic.routes(server), *ollama.routes(server),
    ], lifespan=lifespan, exception_handlers={404: not_found, 405: not_found})
