"""A server speaking OpenAI's, Anthropic's and Ollama's APIs: ``python -m mlx_dgemma.server`` (app.py the
HTTP side, with body.py reading bodies and writing replies as JSON; jobs.py a chat or completions body
read field by field and made into the worker's jobs, resolved; events.py their events; api.py what an
API is, openai_api.py / ollama.py / responses.py / anthropic.py the APIs' translations, embeddings.py
the embedding routes, tokenize.py vLLM's tokenizer routes, routes.py all their routes on one app,
scheduler.py the worker that owns the model and drives the batched engine, stop_strings.py an answer's
stop strings as it grows, prompt_cache.py the multi-turn prefix cache).

The server is an entry point: importing it loads the fast BLAS before mlx.core (fast_blas.py)."""

from .. import fast_blas
from ..errors import MissingExtra

try:
    import starlette  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as e:
    raise MissingExtra(e.name, "the server", "server", __name__) from None

fast_blas.load()

from .app import Limits, Server
from .routes import create_app
from .scheduler import Scheduler

__all__ = ["Limits", "Server", "Scheduler", "create_app"]
