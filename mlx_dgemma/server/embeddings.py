"""Embeddings: OpenAI's ``POST /v1/embeddings``, Ollama's ``POST /api/embed`` and its older ``POST
/api/embeddings``. A request's texts are checked and tokenized on the server's prepare threads, embedded
by the worker between generation steps (mlx_dgemma/engine/embeddings.py: each text's mean final-normed
encoder state, L2-normalized) and answered in the API's own shape; errors are its own too."""

from __future__ import annotations

import base64
import time

import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..errors import TokenizerError
from ..validate import is_int, shown
from .api import BadRequest, error_response
from .app import Server
from .body import check_unicode
from .ollama import model_name, ollama_error, tagged

MAX_INPUTS = 2048  # texts in one request (OpenAI's limit)
MAX_REQUEST_TOKENS = 300_000  # a request's texts together, in tokens (OpenAI's limit)


class Embeddings:
    """One embeddings API: where its body keeps the texts (``inputs``), whether a text past the context
    is cut to it or refused (``truncates``), and the answer's and errors' shapes. One instance per
    request."""

    too_long = "shorten it"  # what to do with a text past the context

    def __init__(self, server: Server):
        self.server = server
        self.started = time.monotonic_ns()

    def inputs(self, body: dict) -> list[tuple[str, str | list[int]]]:
        """The texts (or token ids), each with its name in the body (``input[2]``)."""
        raise NotImplementedError

    def truncates(self, body: dict) -> bool:
        return False

    def reply(self, vectors, rows: list[list[int]]) -> dict:
        raise NotImplementedError

    def renamed(self, e: BadRequest) -> BadRequest:  # (errors name the API's own fields already)
        return e

    def error_reply(self, e: BadRequest) -> Response:
        return error_response(str(e), e.status, e.param, e.code)

    def rows(self, body: dict) -> list[list[int]]:
        """The ids each text is embedded from (as a completions prompt is tokenized, ``<bos>`` first),
        within the limits: at most ``MAX_INPUTS`` texts, each within the model's context (or cut to it
        where the API truncates), ``MAX_REQUEST_TOKENS`` together."""
        check_unicode(body)
        server = self.server
        server.reader.check_model(model_name(server, body.get("model")))
        width = server.model.config.hidden_size
        if (dimensions := body.get("dimensions")) is not None and dimensions != width:
            raise BadRequest(
                f"dimensions must be {width} (the model's width) or left out, got {shown(dimensions)}: "
                "its pooled states are not trained to be cut",
                param="dimensions",
            )
        inputs = self.inputs(body)
        field = inputs[0][0].partition("[")[0] if inputs else None
        if len(inputs) > MAX_INPUTS:
            raise BadRequest(
                f"{field} has {len(inputs)} texts, more than the {MAX_INPUTS} one request may embed; "
                "send them in several requests",
                param=field,
            )
        truncate, context, vocab = self.truncates(body), server.context, server.model.config.vocab_size
        rows, total = [], 0
        for name, text in inputs:
            if isinstance(text, str):
                if truncate:  # (no more characters than the context's tokens can take: bounded work)
                    text = text[: server.reader.max_text_chars]
                server.reader.check_length(len(text), name, field)
                try:
                    ids = server.tokenizer.encode(text)
                except TokenizerError as e:
                    raise BadRequest(f"{name}: {e}", param=field) from None
            else:
                ids = text
                if bad := [i for i in ids if not 0 <= i < vocab]:
                    raise BadRequest(
                        f"{name} holds token id {shown(bad[0])}, outside the vocabulary (0..{vocab - 1})", param=field
                    )
            if len(ids) > context:
                if not truncate:
                    raise BadRequest(
                        f"{name} is {len(ids)} tokens, more than the model's context of {context}; {self.too_long}",
                        param=field,
                        code="context_length_exceeded",
                    )
                ids = ids[:context]
            if not ids:
                raise BadRequest(f"{name} has no tokens to embed; send some text", param=field)
            total += len(ids)
            if total > MAX_REQUEST_TOKENS:
                raise BadRequest(
                    f"{field}'s texts are more than {MAX_REQUEST_TOKENS} tokens together (by {name}), "
                    "more than one request may embed; send them in several requests",
                    param=field,
                )
            rows.append(ids)
        return rows


def _token_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(is_int(i) for i in value)


class OpenAIEmbeddings(Embeddings):
    """``/v1/embeddings``: ``input`` a string, a list of them, token ids or a list of those;
    ``encoding_format`` float or base64 (the ``openai`` client's default: little-endian float32)."""

    def inputs(self, body: dict) -> list[tuple[str, str | list[int]]]:
        fmt = body.get("encoding_format")
        if fmt not in (None, "float", "base64"):
            raise BadRequest(f'encoding_format must be "float" or "base64", got {shown(fmt)}', param="encoding_format")
        self.base64 = fmt == "base64"
        value = body.get("input")
        if isinstance(value, str) and value or _token_ids(value):
            return [("input", value)]
        if not (isinstance(value, list) and value):
            raise BadRequest(
                f"input must be a non-empty string, a list of them, token ids or a list of those, got {shown(value)}",
                param="input",
            )
        for i, text in enumerate(value):
            if not (isinstance(text, str) and text or _token_ids(text)):
                raise BadRequest(
                    f"input[{i}] must be a non-empty string or a non-empty list of token ids, got {shown(text)}",
                    param="input",
                )
        return [(f"input[{i}]", text) for i, text in enumerate(value)]

    def reply(self, vectors, rows: list[list[int]]) -> dict:
        def encoded(vector):
            return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode() if self.base64 else vector.tolist()

        tokens = sum(map(len, rows))
        return {
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)],
            "model": self.server.model_id,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }


class OllamaEmbed(Embeddings):
    """``/api/embed``: ``input`` a string or a list of them, cut to the context unless ``truncate`` is
    false; ``options`` and ``keep_alive`` change nothing. No input answers no embeddings (Ollama's way
    of loading a model)."""

    too_long = "shorten it or leave truncate out"

    def inputs(self, body: dict) -> list[tuple[str, str | list[int]]]:
        self.name = _ollama_name(self.server, body)
        value = body.get("input")
        if value is None or value == "":
            return []
        if isinstance(value, str):
            return [("input", value)]
        if not (isinstance(value, list) and all(isinstance(text, str) for text in value)):
            raise BadRequest(f"input must be a string or a list of strings, got {shown(value)}", param="input")
        return [(f"input[{i}]", text) for i, text in enumerate(value)]

    def truncates(self, body: dict) -> bool:
        truncate = body.get("truncate")
        if not isinstance(truncate, (bool, type(None))):
            raise BadRequest(f"truncate must be true or false, got {shown(truncate)}", param="truncate")
        return truncate is not False

    def reply(self, vectors, rows: list[list[int]]) -> dict:
        return {
            "model": self.name,
            "embeddings": [v.tolist() for v in vectors],
            "total_duration": time.monotonic_ns() - self.started,
            "load_duration": 0,
            "prompt_eval_count": sum(map(len, rows)),
        }

    def error_reply(self, e: BadRequest) -> Response:
        return ollama_error(str(e), e.status)


class OllamaEmbeddings(OllamaEmbed):
    """``/api/embeddings`` (Ollama's older route): one ``prompt``, answered ``{"embedding": [...]}``
    (the same vector ``/api/embed`` gives it)."""

    def inputs(self, body: dict) -> list[tuple[str, str | list[int]]]:
        self.name = _ollama_name(self.server, body)
        prompt = body.get("prompt")
        if not isinstance(prompt, (str, type(None))):
            raise BadRequest(f"prompt must be a string, got {shown(prompt)}", param="prompt")
        return [("prompt", prompt)] if prompt else []

    def reply(self, vectors, rows: list[list[int]]) -> dict:
        return {"embedding": vectors[0].tolist() if len(vectors) else []}


def _ollama_name(server: Server, body: dict) -> str:
    """The model's name as the request gave it (Ollama answers with it), checked."""
    options = body.get("options")
    if not isinstance(options, (dict, type(None))):
        raise BadRequest(f"options must be an object, got {shown(options)}", param="options")
    name = body.get("model")
    return name if model_name(server, name) == server.model_id else tagged(server.model_id)


def routes(server: Server) -> list[Route]:
    def endpoint(api):
        async def embed(request: Request):
            return await server.embed(request, api(server))

        return embed

    return [
        Route("/v1/embeddings", endpoint(OpenAIEmbeddings), methods=["POST"]),
        Route("/api/embed", endpoint(OllamaEmbed), methods=["POST"]),
        Route("/api/embeddings", endpoint(OllamaEmbeddings), methods=["POST"]),
    ]
