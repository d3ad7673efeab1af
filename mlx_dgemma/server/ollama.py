"""Ollama's API on the shared request model: ``/api/chat`` and ``/api/generate`` become the chat or
completions body app.py reads, their answers NDJSON lines (streamed by default) or one object, and
errors ``{"error": "..."}``. ``/api/tags``, ``/api/ps``, ``/api/show`` and ``/api/version`` describe the
model, by Ollama's ``name:tag`` (``demo:latest``, also answered as ``demo``) and a digest of the
checkpoint (clients such as llm-ollama cache what they learn of a model by it)."""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import asdict
from datetime import datetime, timezone

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..model.vision import has_vision
from ..validate import shown_json
from .api import MANY_STOP_STRINGS, Answer, Api, BadRequest, Reply, given
from .app import Server
from .settings import SETTINGS

OLLAMA_VERSION = "0.12.0"  # the Ollama release whose API these endpoints follow
DIGEST_SAMPLES = 64  # values of each weight the digest reads (evenly spaced): a fine-tune changes them
NEVER = "2318-01-01T00:00:00Z"  # /api/ps's expires_at: the server keeps its model loaded (Ollama's keep_alive -1)


class Ollama(Api):
    """``/api/chat`` (``chat``) or ``/api/generate``."""

    stream_type = "application/x-ndjson"
    max_stop = MANY_STOP_STRINGS
    caps_max_tokens = True  # num_predict: at most that many tokens, as many as the context holds
    # Ollama's options carry the sampler settings (temperature, top_p, top_k, min_p, seed), and here the
    # server's own (policy, steps, template, ...).
    names = {
        "max_tokens": "options.num_predict",
        "response_format": "format",
        "reasoning_effort": "think",
        **{key: f"options.{key}" for key in ("stop", "template", *SETTINGS)},
        "repetition_penalty": "options.repeat_penalty",
    }

    def __init__(self, server: Server, chat: bool):
        super().__init__(server)
        self.chat = chat
        self.started = time.monotonic_ns()
        self.name = None  # the model's name as the request gave it (Ollama answers with it)

    def translate(self, body: dict) -> tuple[dict, bool] | None:
        options = body.get("options") or {}
        if not isinstance(options, dict):
            raise BadRequest('options must be an object such as {"temperature": 0.7, "seed": 1}', param="options")
        predict = options.get("num_predict")
        self.name = body.get("model") if model_name(self.server, body.get("model")) == self.server.model_id else None
        shared = {
            "model": model_name(self.server, body.get("model")),
            "stream": True if body.get("stream") is None else body["stream"],
            "stop": options.get("stop"),
            # (-1: no limit, -2: fill the context; both the server's default)
            "max_tokens": None if isinstance(predict, int) and predict < 0 else predict,
            "response_format": _response_format(body.get("format")),
            "reasoning_effort": _effort(body.get("think")),
            **{key: options.get(key) for key in ("template", *SETTINGS)},
            "repetition_penalty": options.get("repeat_penalty"),
        }
        if self.chat:
            messages = body.get("messages")
            if not messages:  # Ollama's way of loading a model
                return None
            if isinstance(messages, list):
                messages = [self._message(m, i) for i, m in enumerate(messages)]
            return given({**shared, "messages": messages, "tools": body.get("tools")}), True
        for key in ("template", "context"):
            if body.get(key):
                raise BadRequest(f"{key} is not supported by this server; leave it out", param=key)
        for key in ("prompt", "suffix", "system"):
            if not isinstance(body.get(key, ""), (str, type(None))):
                raise BadRequest(f"{key} must be a string", param=key)
        prompt, suffix, images = body.get("prompt"), body.get("suffix"), body.get("images")
        if images and (suffix or body.get("raw")):
            raise BadRequest("images go through the chat template: leave out suffix and raw", param="images")
        if suffix:  # the prompt is the prefix: no chat template
            return given({**shared, "prompt": prompt or "", "suffix": suffix}), False
        if not prompt and not images:
            return None
        if body.get("raw"):
            return given({**shared, "prompt": prompt}), False
        if images is not None and not (isinstance(images, list) and all(isinstance(i, str) for i in images)):
            raise BadRequest("images must be a list of base64-encoded images", param="images")
        system = body.get("system")
        self.origins = [None] * bool(system) + ["images"]  # (the user message's errors are its images')
        user = self._message({"role": "user", "content": prompt or "", "images": images}, 0)
        return given({**shared, "messages": [{"role": "system", "content": system}] * bool(system) + [user]}), True

    @staticmethod
    def _message(message, index: int):
        """An Ollama message as a chat message: its base64 ``images`` become image parts before its text."""
        if not isinstance(message, dict) or not message.get("images"):
            return message
        images = message["images"]
        if not (isinstance(images, list) and all(isinstance(i, str) for i in images)):
            raise BadRequest(f"messages[{index}].images must be a list of base64-encoded images", param="messages")
        content = message.get("content") or ""
        if not isinstance(content, str):
            raise BadRequest(f"messages[{index}].content must be a string", param="messages")
        parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + i}} for i in images]
        return {
            **{k: v for k, v in message.items() if k != "images"},
            "content": parts + [{"type": "text", "text": content}],
        }

    def reply(self, answer: Answer, reply: Reply) -> dict:
        return self._line(answer, done=True)

    async def stream(self, events, reply: Reply):
        async for event in events:
            if event.error is not None:
                yield _ndjson({"error": str(event.error)})
                return
            if event.finish_reason is None:
                if event.content or event.reasoning:
                    yield _ndjson(self._line(Answer(event.content, event.reasoning, [], ""), done=False))
                continue
            last = self.server.answer(event, reply)
            if last.content or last.reasoning or last.calls:
                yield _ndjson(self._line(last, done=False))
            yield _ndjson(self._line(Answer("", "", [], last.finish, last.usage), done=True))

    def _line(self, answer: Answer, done: bool) -> dict:
        """One NDJSON line (or the whole reply): the answer's text, thinking and tool calls, and once
        ``done`` why it ended and the counts."""
        out = {"model": self.name or tagged(self.server.model_id), "created_at": _now()}
        if self.chat:
            message = {"role": "assistant", "content": answer.content}
            if answer.reasoning:
                message["thinking"] = answer.reasoning
            if answer.calls:
                message["tool_calls"] = [
                    {
                        "id": f"call_{secrets.token_hex(12)}",
                        "function": {"index": index, "name": name, "arguments": json.loads(arguments)},
                    }
                    for index, (name, arguments) in enumerate(answer.calls)
                ]
            out["message"] = message
        else:
            out["response"] = answer.content
            if answer.reasoning:
                out["thinking"] = answer.reasoning
        out["done"] = done
        if done:
            usage = answer.usage
            out.update(
                done_reason="length" if answer.finish == "length" else "stop",
                total_duration=time.monotonic_ns() - self.started,
                load_duration=0,
                prompt_eval_count=usage.prompt_tokens,
                eval_count=usage.completion_tokens,
            )
        return out

    def error_reply(self, e: BadRequest) -> Response:
        return ollama_error(str(e), e.status)

    def empty(self) -> Response:
        """What Ollama answers a request with nothing to generate: the model is loaded."""
        text = {"message": {"role": "assistant", "content": ""}} if self.chat else {"response": ""}
        return JSONResponse(
            {
                "model": self.name or tagged(self.server.model_id),
                "created_at": _now(),
                **text,
                "done": True,
                "done_reason": "load",
            }
        )


def ollama_error(message: str, status: int) -> Response:
    """Ollama's error shape."""
    return JSONResponse({"error": message}, status)


def tagged(model_id: str) -> str:
    """``model_id`` as Ollama names models, ``name:tag`` (``:latest`` unless it has a tag)."""
    return model_id if ":" in model_id.rpartition("/")[2] else f"{model_id}:latest"


def model_name(server: Server, name):
    """The server's model id for its Ollama name (``demo:latest`` for ``demo``); any other name is left
    to the shared check."""
    return server.model_id if name == tagged(server.model_id) else name


def digest(model) -> str:
    """A digest of the checkpoint ``model`` holds, stable across loads, which another checkpoint does not
    share: a hash of its config and of each weight's name, shape, dtype and values at evenly spaced
    places (read from memory; the weights themselves are not hashed, which takes minutes on the
    released model)."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    sha = hashlib.sha256(json.dumps(asdict(model.config), sort_keys=True, default=str).encode())
    for name, weight in tree_flatten(model.parameters()):
        flat = weight.reshape(-1)
        step = max(1, flat.size // DIGEST_SAMPLES)
        sample = flat[::step][:DIGEST_SAMPLES]
        if sample.dtype == mx.bfloat16:  # (numpy has no bfloat16: the same bits as 16-bit integers)
            sample = sample.view(mx.uint16)
        sha.update(f"{name} {weight.shape} {weight.dtype}".encode() + np.asarray(sample).tobytes())
    return sha.hexdigest()


def _effort(think) -> str | None:
    """Ollama's ``think`` (true, false, or a level) as the chat body's reasoning effort."""
    if think is None or think in ("low", "medium", "high"):
        return think
    if isinstance(think, bool):
        return "medium" if think else "none"
    raise BadRequest(
        f'think must be true, false, "low", "medium" or "high", got {shown_json(think)}', param="reasoning_effort"
    )


def _response_format(value) -> dict | None:
    if value in (None, ""):
        return None
    if value == "json":  # any object, as Ollama answers it
        return {"type": "json_object"}
    if isinstance(value, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": value}}
    raise BadRequest(f'format must be "json" or a JSON schema, got {shown_json(value)}', param="format")


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _ndjson(data: dict) -> str:
    return json.dumps(data) + "\n"


class Models:
    """The model as Ollama's ``/api/tags`` and ``/api/show`` describe it."""

    def __init__(self, server: Server):
        import mlx.core as mx
        from mlx.utils import tree_flatten

        self.server = server
        weights = [w for _, w in tree_flatten(server.model.parameters())]
        config = server.model.config
        self.size = sum(w.nbytes for w in weights)
        parameters = sum(w.size for w in weights)
        quantization = getattr(config, "quantization", None)
        self.details = {
            "parent_model": "",
            "format": "safetensors",
            "family": "gemma4",
            "families": ["gemma4"],
            "parameter_size": _count(parameters),
            "quantization_level": f"Q{quantization['bits']}"
            if quantization and "bits" in quantization
            else str(weights[0].dtype).removeprefix("mlx.core.").upper(),
        }
        self.info = {
            "general.architecture": "gemma4",
            "general.parameter_count": parameters,
            "gemma4.context_length": server.context,
        }
        tokenizer = server.tokenizer
        self.capabilities = (
            ["completion", "insert"]
            + ["tools"] * tokenizer.renders_tools  # as the template does
            + ["thinking"] * tokenizer.renders_thinking
        )
        if has_vision(server.model) and tokenizer.has_vocabulary:
            with_image = tokenizer.apply_chat_template(
                [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}], tokenize=True
            )
            if config.image_token_id in with_image:  # the chat template takes images
                self.capabilities.append("vision")
        self.modified = datetime.fromtimestamp(server.created, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.name, self.digest = tagged(server.model_id), digest(server.model)
        on_gpu = mx.default_device() == mx.gpu
        self.loaded = {
            "name": self.name,
            "model": self.name,
            "size": self.size,
            "digest": self.digest,
            "details": self.details,
            "expires_at": NEVER,
            "size_vram": self.size if on_gpu else 0,
            "context_length": server.context,
        }

    async def tags(self, request: Request):
        return JSONResponse(
            {
                "models": [
                    {
                        "name": self.name,
                        "model": self.name,
                        "modified_at": self.modified,
                        "size": self.size,
                        "digest": self.digest,
                        "details": self.details,
                    }
                ]
            }
        )

    async def ps(self, request: Request):
        """The models in memory: the server's, loaded for as long as it runs."""
        return JSONResponse({"models": [self.loaded]})

    async def show(self, request: Request):
        try:
            body = await self.server.read_body(request)
        except BadRequest as e:
            return ollama_error(str(e), e.status)
        name = body.get("model", body.get("name"))
        if model_name(self.server, name) != self.server.model_id:
            return ollama_error(f"model {shown_json(name, 80)} not found; this server serves '{self.name}'", 404)
        return JSONResponse(
            {
                "modelfile": "",
                "parameters": "",
                "template": "",
                "details": self.details,
                "model_info": self.info,
                "capabilities": self.capabilities,
                "modified_at": self.modified,
            }
        )

    async def version(self, request: Request):
        return JSONResponse({"version": OLLAMA_VERSION})


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def routes(server: Server) -> list[Route]:
    models = Models(server)

    async def chat(request: Request):
        return await server.respond(request, Ollama(server, chat=True))

    async def generate(request: Request):
        return await server.respond(request, Ollama(server, chat=False))

    return [
        Route("/api/chat", chat, methods=["POST"]),
        Route("/api/generate", generate, methods=["POST"]),
        Route("/api/tags", models.tags, methods=["GET"]),
        Route("/api/ps", models.ps, methods=["GET"]),
        Route("/api/show", models.show, methods=["POST"]),
        Route("/api/version", models.version, methods=["GET"]),
    ]
