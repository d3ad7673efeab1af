"""The HTTP side on starlette: one request model under every API the server speaks.

Every endpoint is an ``Api`` (api.py): a translation of its JSON into the chat or completions body read
here (OpenAI's, so every API shares the same checks, templates, tool parsing, limits and streaming), and
of the answer back into its own shape (openai_api.py, ollama.py, responses.py and anthropic.py).
A request becomes the prompt's ids and one ``options.GenerationArgs`` (settings.py reads its options),
which the worker makes ready and runs.
A request is read and checked here (the body's size, its JSON, the model, every setting, the prompt
against the context, the template or schema, the images), so anything wrong gets OpenAI's error shape
with a 4xx status before the worker sees it. Everything past reading the body (parsing its JSON,
rendering, tokenizing, building templates, decoding images) runs on a small thread pool, each part
bounded by a limit checked before it starts (docs/server.md, "Limits and hostile input"): the event
loop stays free to answer.
The worker's events come back as one JSON reply or as server-sent events, a chunk per committed canvas.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
import time
import warnings
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from .. import validate
from ..engine.resolve import answer_room, check_prompt_fits, generation_config, resolve
from ..errors import PromptError
from ..model.images import ImageError, ImageInputs, decode_image, image_inputs, open_image_url
from ..model.vision import has_vision
from ..options import GenerationArgs
from ..structured.template import CanvasTemplate, TemplateError, infill_template
from ..structured.tool_calls import CALL_OPEN, check_parameters, chosen_call, parse_tool_calls
from . import fields, reasoning, request_log
from .api import MAX_STOP_STRINGS, Answer, Api, BadRequest, Reply
from .body import check_unicode, json_reply, parsed
from .events import choice_events, job_events, next_event
from .layout import AskedLayout, asked_layout, strings, typed
from .scheduler import EmbeddingJob, Event, Job, Scheduler, failure
from .settings import request_options

MAX_REQUEST_BYTES = 32 << 20  # room for a few images sent as data URLs (base64: 4/3 of the file)
MAX_IMAGES = 8  # image parts in one request
MAX_REQUEST_PIXELS = 1 << 24  # a request's images together, by their headers (four 2048x2048 photos)
PREPARE_THREADS = 2  # requests rendered, tokenized and decoded at once (bounds their memory too)
@dataclass(frozen=True)
class Limits:
    """What the server accepts of a request."""

    max_tokens: int | None = None  # a request's default max_tokens (None: the checkpoint's); the context bounds any
    max_request_bytes: int = MAX_REQUEST_BYTES
    max_images: int = MAX_IMAGES
    max_image_pixels: int = MAX_REQUEST_PIXELS  # a request's images together
    image_dir: str | Path | None = None  # whose regular files an image_url path may name (None: data URLs only)
    max_steps: int = validate.MAX_STEPS  # denoising steps a request may ask for (at most validate.MAX_STEPS)


class Server:
    """The endpoints, for requests within ``limits``."""

    def __init__(self, model, tokenizer, model_id: str, scheduler: Scheduler, limits: Limits = Limits(),
                 options: dict | None = None, chat_template_args: dict | None = None):
        """``options``: the generation options a request that does not set them gets (by body field name,
        the server's --temp, --top-p...: checked as a request's are, a ``BadRequest`` naming the field);
        ``chat_template_args``: the chat template's arguments for every request (``enable_thinking``:
        thinking on unless a request turns it off)."""
        from PIL.Image import DecompressionBombWarning

        self.model, self.tokenizer, self.model_id, self.scheduler = model, tokenizer, model_id, scheduler
        self.defaults = generation_config(model, tokenizer)
        self.limits = limits
        self.options = request_options(options or {}, self.defaults, model.config.canvas_length, limits.max_steps)
        self.chat_template_args = chat_template_args or {}
        self.max_tokens = limits.max_tokens or self.defaults.max_new_tokens
        self.context = model.config.max_position_embeddings
        # No token is longer than the vocabulary's longest: text longer than that many per position
        # cannot fit the context, and is refused before it is rendered or tokenized.
        self.max_text_chars = self.context * max(
            [len(tokenizer.piece(i)) for i in range(model.config.vocab_size)] if tokenizer.has_vocabulary else [1])
        self._preparing = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="mlx-dgemma-prepare")
        # Pillow warns (on stderr) of images past its own bound, larger than images.MAX_IMAGE_PIXELS:
        # here they are refused with the request's one-line error instead.
        warnings.filterwarnings("error", category=DecompressionBombWarning)
        self.created = int(time.time())
        self._numbers = itertools.count(1)  # the requests' numbers in the log

    # -- endpoints ----------------------------------------------------------------------------------

    async def health(self, request: Request):
        return JSONResponse({"status": "ok", **self.scheduler.status()})

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "mlx-dgemma"}]})

    async def respond(self, request: Request, api: Api) -> Response:
        """Read, translate and check ``request``'s body, run it, and answer in ``api``'s shape."""
        number = next(self._numbers)
        try:
            body = await self.read_body(request, number)
            prepared = await self.off_loop(self._prepare, api, body)
            if prepared is None:
                return api.empty()
            jobs, reply = prepared
            queues = [self.scheduler.submit(job) for job in jobs]
            if reply.stream:
                return StreamingResponse(self._streamed(api, jobs, queues, reply, request), media_type=api.stream_type,
                                         headers={"Cache-Control": "no-cache"})
            answers = await self._wholes(jobs, queues, reply, request)
            return await self.off_loop(lambda: json_reply(api.replies(answers, reply)))
        except BadRequest as e:
            return self._refused(number, request, api, e)

    async def count_tokens(self, request: Request, api: Api) -> Response:
        """The prompt tokens ``request``'s body would be answered from (its messages and tools through
        the chat template), as ``{"input_tokens": n}``; errors in ``api``'s shape."""
        return await self.worked(request, api, lambda body: {"input_tokens": self._count(api, body)})

    async def worked(self, request: Request, api: Api, work) -> Response:
        """``work(body)``'s JSON for ``request``'s body, worked out on the preparing threads (no model
        forward: the worker's are its own); errors in ``api``'s shape."""
        number = next(self._numbers)
        try:
            body = await self.read_body(request, number)
            return JSONResponse(await self.off_loop(work, body))
        except BadRequest as e:
            return self._refused(number, request, api, e)

    async def embed(self, request: Request, api) -> Response:
        """Embed the texts of ``request``'s body on the worker; ``api`` (embeddings.py) reads them, checked
        and tokenized on the prepare threads, and shapes the answer and errors."""
        number = next(self._numbers)
        try:
            body = await self.read_body(request, number)
            rows = await self.off_loop(api.rows, body)
            if not rows:
                return JSONResponse(api.reply([], rows))  # (Ollama's way of loading a model)
            job = EmbeddingJob(rows)
            result = await next_event(self.scheduler.submit(job), request)
            if result is None:
                job.cancel()
                raise BadRequest("the client went away", status=499)
            if isinstance(result, Event):
                raise BadRequest(str(result.error), param=result.error.param, status=result.error.status)
            return await self.off_loop(lambda: json_reply(api.reply(result, rows)))
        except BadRequest as e:
            return self._refused(number, request, api, e)

    def _refused(self, number: int, request: Request, api: Api, e: BadRequest) -> Response:
        e = api.renamed(e)
        request_log.refused(number, request.url.path, e.status, str(e), e.param)
        return api.error_reply(e)

    def _count(self, api: Api, body: dict) -> int:
        check_unicode(body)  # (by the field the client sent)
        body, _ = api.translate(body)
        api.translated = True  # (errors from here on use the API's names)
        self._check_model(body.get("model"))
        tools, forced = self._tools(body)
        return len(self._check_ids(self._chat_prompt(body, tools if tools and not forced else None)[0], "messages"))

    def _check_model(self, model) -> None:
        if model not in (None, self.model_id, "default_model"):
            raise BadRequest(f"the model {validate.shown_json(model, 80)} does not exist; this server serves "
                             f"'{self.model_id}'", param="model", code="model_not_found", status=404)

    def _prepare(self, api: Api, body: dict) -> tuple[list[Job], Reply] | None:
        """The request's jobs (``n`` choices of each prompt, a completions request's prompt array taking
        several, in order) and its reply."""
        check_unicode(body)  # (by the field the client sent)
        translated = api.translate(body)
        api.translated = True
        if translated is None:
            return None
        body, chat = translated
        prompts = [None] if chat else fields.prompts(body)
        jobs, echoes = [], []
        for i, prompt in enumerate(prompts):
            try:
                choices, reply = self._job(body if chat else {**body, "prompt": prompt}, chat, max_stop=api.max_stop,
                                           cap_max_tokens=api.caps_max_tokens)
            except BadRequest as e:
                if len(prompts) == 1 or e.param != "prompt":
                    raise
                raise BadRequest(f"prompt[{i}]: {e}", "prompt", e.code, e.status) from None
            if len(jobs) + len(choices) > fields.MAX_PROMPTS:
                raise BadRequest(f"{len(prompts)} prompts of n {reply.n} choices each are more than the {fields.MAX_PROMPTS} "
                                 "choices one request takes; send fewer prompts or a smaller n", param="n")
            jobs += choices
            echoes += reply.echoes or []
        reply.echoes, reply.prompts = echoes or None, len(prompts)
        return jobs, reply

    # -- reading a request -------------------------------------------------------------------------

    async def off_loop(self, function, *args):
        """``function(*args)`` on the prepare threads: the event loop answers others meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._preparing, function, *args)

    async def read_body(self, request: Request, number: int | None = None) -> dict:
        """``request``'s body as a JSON object, read on the event loop up to the size limit and parsed
        off it (``number``: the request's in the log, where it is outlined once parsed)."""
        limit = self.limits.max_request_bytes
        too_big = BadRequest(f"the request body is over the server's limit of {limit} bytes; send less, or "
                             "start the server with a larger --max-request-bytes", code="request_too_large", status=413)
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise too_big
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_big
        return await self.off_loop(parsed, body, number, request.url.path)

    def _job(self, body: dict, chat: bool, max_stop: int = MAX_STOP_STRINGS,
             cap_max_tokens: bool = False) -> tuple[list[Job], Reply]:
        """The request's jobs, one per choice (``n``), and how to shape their answers."""
        fields.check_supported(body, chat)
        self._check_model(body.get("model"))
        stream = typed(body, "stream", bool, False)
        n = typed(body, "n", int, 1)
        if not 1 <= n <= fields.MAX_CHOICES:
            raise BadRequest(f"n must be from 1 to {fields.MAX_CHOICES}, the choices this server runs for one request, "
                             f"got {n}", param="n")
        stream_options = typed(body, "stream_options", dict, None) or {}
        max_key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = typed(body, max_key, int, None)
        top, echo = fields.logprobs(body, chat)
        if max_tokens is not None and max_tokens < (0 if echo else 1):
            scored = "" if chat else " (0 with echo true: the prompt alone)"
            raise BadRequest(f"{max_key} must be at least 1{scored}, got {validate.shown(max_tokens)}", param=max_key)
        stop = typed(body, "stop", (str, list), None) or []
        stop = [stop] if isinstance(stop, str) else stop
        if len(stop) > max_stop or not all(isinstance(s, str) and s for s in stop):
            raise BadRequest(f"stop must be a non-empty string or a list of at most {max_stop}", param="stop")
        options = {**self.options, **request_options(body, self.defaults, self.model.config.canvas_length,
                                                     self.limits.max_steps)}

        tools, forced = self._tools(body) if chat else ([], None)
        suffix = None if chat else typed(body, "suffix", str, None) or None
        # A JSON answer (a schema, json_object, a forced call) starts at once: no thought before it.
        think = reasoning.thinks(body, chat, self.tokenizer.renders_thinking,
                                 self.chat_template_args.get("enable_thinking", False)) and forced is None and (
            typed(body, "response_format", dict, None) or {}).get("type", "text") == "text"
        ids, vision_inputs = (self._chat_prompt(body, tools if tools and not forced else None, think) if chat
                              else (self._text_prompt(body, empty=suffix is not None), {}))
        job = Job(ids, GenerationArgs(), stop=stop, hold=[CALL_OPEN] if tools and not forced else [],
                  whole=forced is not None, prompt_param="messages" if chat else "prompt", think=think,
                  logprobs=top, echo=echo, stream=stream)
        reply = Reply(chat, stream, bool(stream_options.get("include_usage")), bool(tools) and not forced,
                      tuple(t["function"]["name"] for t in forced or ()),
                      id=f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}", prompt_tokens=len(ids), n=n,
                      logprobs=top is not None, echoes=[self._echo(body, ids)] * n if echo else None)
        if max_tokens == 0:  # the prompt scored, nothing generated (a stop, a suffix or a layout has no answer to shape)
            self._check_ids(ids, job.prompt_param)
            job.args = GenerationArgs.of(**options, max_tokens=0)
            return [job, *(fields.choice(job, i) for i in range(1, n))], reply
        asked = AskedLayout()
        if suffix is None:
            asked = asked_layout(self, body, forced)
            if asked.given:
                job.stop = []  # stop strings are for free text: they never cut a structured answer
                job.template_param = asked.param
            if cap_max_tokens and max_tokens is not None:
                max_tokens = min(max_tokens, answer_room(ids, self.model.config))
            template = asked.template
        else:
            template, max_tokens = self._infill(job, body, suffix, max_tokens)
        job.args = GenerationArgs.of(**options, max_tokens=max_tokens, template=template, schema=asked.schema,
                                     images=ImageInputs(vision_inputs) if vision_inputs else None)
        job.max_tokens_param = max_key
        try:  # everything about the request that needs no device, checked once: the worker plans it
            job.resolved = resolve(self.model, self.tokenizer, ids, job.args, self.max_tokens, asked.reads_call)
        except ValueError as e:
            refused = failure(job, e, bad_input=ValueError)
            raise BadRequest(str(refused), param=refused.param,
                             code="context_length_exceeded" if getattr(e, "context", False) else None) from None
        return [job, *(fields.choice(job, i) for i in range(1, n))], reply

    def _echo(self, body: dict, ids: list[int]) -> str:
        """The text echoed before a completion: the prompt as sent, or its ids' text."""
        prompt = body.get("prompt")
        prompt = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str) else prompt
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)

    def _tools(self, body: dict) -> tuple[list[dict], dict | None]:
        """The request's tools (none with tool_choice "none") and those a forced call is to (one of them:
        tool_choice "required", or the one it names), or None."""
        tools = typed(body, "tools", list, None) or []
        for tool in tools:
            function = tool.get("function") if isinstance(tool, dict) else None
            if not (isinstance(function, dict) and tool.get("type") == "function"
                    and isinstance(function.get("name"), str)
                    and isinstance(function.get("parameters", {}), (dict, type(None)))):
                raise BadRequest('each tool must be {"type": "function", "function": {"name": ..., "parameters": '
                                 '{a JSON schema}}}', param="tools")
            try:
                check_parameters(function)
            except TemplateError as e:
                raise BadRequest(str(e), param="tools") from None
        choice = body.get("tool_choice", "auto" if tools else "none")
        if choice == "none":
            return [], None
        if choice == "auto":
            return tools, None
        if not tools:
            raise BadRequest("tool_choice needs tools", param="tool_choice")
        if choice == "required":
            return tools, tools
        function = choice.get("function") if isinstance(choice, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        named = [t for t in tools if t["function"]["name"] == name]
        if not named:
            raise BadRequest(f"tool_choice must be 'none', 'auto', 'required' or name one of the tools, "
                             f"got {validate.shown(choice)}", param="tool_choice")
        return tools, named[:1]

    def _chat_prompt(self, body: dict, tools: list[dict] | None, think: bool = False) -> tuple[list[int], dict]:
        """The messages' ids through the chat template (``think``: with its thinking switch on), and their
        images as ``model.encode`` takes them."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list", param="messages")
        plain, images = [], []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise BadRequest(f"messages[{i}] must be an object with a role", param="messages")
            content, pictures = self._content(message.get("content"), i, len(images))
            plain.append({**message, "content": content})
            images += pictures
        # Only text the template renders counts: the images are out of it by now (their data URLs are no
        # text for the template), and so are tools where the template writes none (the demo's; clients
        # such as Open WebUI send dozens with every chat).
        tools = tools if tools and self.tokenizer.renders_tools else None
        self._check_length(sum(map(len, strings([plain, tools]))),
                           "the text of the messages and tools" if tools else "the text of the messages", "messages")
        if (pixels := sum(image.width * image.height for image in images)) > self.limits.max_image_pixels:
            raise BadRequest(f"the request's images are {pixels} pixels together, more than the "
                             f"{self.limits.max_image_pixels} accepted; scale them down", param="messages")
        extra = {"tools": tools} if tools else {}
        try:  # (enable_thinking given either way: a template whose default is on is off unless asked)
            text = self.tokenizer.apply_chat_template(plain, add_generation_prompt=True, **{
                **self.chat_template_args, "enable_thinking": think}, **extra)
        except Exception as e:  # the template's own raise_exception, or messages it cannot render
            raise BadRequest(f"the chat template cannot render these messages: {e}", param="messages") from None
        self._check_length(len(text), "the prompt the chat template renders", "messages")  # before tokenizing it
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        vision_inputs = {}
        if images:
            if (placed := ids.count(self.model.config.image_token_id)) != len(images):
                raise BadRequest(f"the chat template wrote {placed} image placeholders for {len(images)} images (a "
                                 "template that takes no image parts, or drops them from some messages)",
                                 param="messages")
            try:  # each placeholder the template wrote becomes its image's soft tokens
                ids, vision_inputs = image_inputs(self.model, ids, [decode_image(image) for image in images])
            except ImageError as e:
                raise BadRequest(f"messages: {e}", param="messages") from None
        return ids, vision_inputs

    def _content(self, content, index: int, earlier_images: int) -> tuple[str | list[dict], list]:
        """A message's content for the chat template (its text, or text and image parts) and its images,
        opened (their headers read, ``open_image_url``)."""
        if content is None:
            return "", []
        if isinstance(content, str):
            return content, []
        if not (isinstance(content, list) and all(isinstance(p, dict) for p in content)):
            raise BadRequest(f"messages[{index}].content must be a string or a list of text and image_url parts",
                             param="messages")
        if kinds := {t[:40] if isinstance(t := p.get("type"), str) else validate.shown_json(t)
                     for p in content} - {"text", "image_url"}:
            raise BadRequest(f"messages[{index}]: content of type {min(map(str, kinds))} is not supported; "
                             f"send text or image_url", param="messages")
        if all(p.get("type") == "text" for p in content):
            return "".join(str(p.get("text", "")) for p in content), []
        if not has_vision(self.model):
            raise BadRequest(f"messages[{index}] has an image, but this model takes text only (no vision tower)",
                             param="messages")
        if (count := earlier_images + sum(p.get("type") == "image_url" for p in content)) > self.limits.max_images:
            raise BadRequest(f"the request has {count} or more images, more than the {self.limits.max_images} accepted",
                             param="messages")
        parts, images = [], []
        for part in content:
            if part.get("type") == "text":
                parts.append({"type": "text", "text": str(part.get("text", ""))})
                continue
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise BadRequest(f'messages[{index}]: an image_url part must be {{"type": "image_url", '
                                 f'"image_url": {{"url": "data:image/png;base64,..."}}}}', param="messages")
            try:
                images.append(open_image_url(url, self.limits.image_dir))
            except ImageError as e:
                raise BadRequest(f"messages[{index}]: {e}", param="messages") from None
            parts.append({"type": "image"})
        return parts, images

    def _text_prompt(self, body: dict, empty: bool = False) -> list[int]:
        """The prompt's ids (an infill's prefix may be ``empty``)."""
        prompt = body.get("prompt", "" if empty else None)
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str) and (prompt or empty):
            self._check_length(len(prompt), "the prompt", "prompt")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            return prompt
        raise BadRequest("prompt must be a non-empty string or a list of token ids", param="prompt")

    def _check_length(self, chars: int, what: str, param: str) -> None:
        """Refuse text that cannot fit the context before it is rendered or tokenized."""
        if chars > self.max_text_chars:
            raise BadRequest(f"{what} is {chars} characters: more than the model's context of {self.context} "
                             f"tokens can hold (at most {self.max_text_chars})", param=param,
                             code="context_length_exceeded")

    def _check_ids(self, ids: list[int], param: str) -> list[int]:
        """A prompt of ids the model can take and answer within its context, for a request that is not
        resolved (a prompt scored alone, tokens counted)."""
        config = self.model.config
        try:
            check_prompt_fits(ids, config)
        except PromptError as e:
            raise BadRequest(str(e), param=param, code="context_length_exceeded" if e.context else None) from None
        return ids

    def _infill(self, job: Job, body: dict, suffix: str, max_tokens: int | None) -> tuple[CanvasTemplate, int]:
        """The prompt is the prefix: the answer is a hole of at least ``max_tokens`` (by default the
        server's, cut to what the context leaves next to the suffix), then the suffix clamped at the end
        of its last canvas; the worker takes the suffix off the answer (``Job.tail``). A hole is
        generated whole, so ``max_tokens`` is no cap here, even for an API whose limit is one (Ollama's
        ``num_predict``): more than the context leaves is refused, not a hole the size of the context."""
        if body.get("template") is not None or (typed(body, "response_format", dict, None) or {}).get(
                "type", "text") != "text":
            raise BadRequest("give one of suffix, template and response_format", param="suffix")
        self._check_length(len(suffix), "the suffix", "suffix")
        ids, canvas = job.ids, self.model.config.canvas_length
        left = (self.context - len(ids)) // canvas * canvas  # whole canvases after the prompt
        tail = len(self.tokenizer.encode(suffix, add_special_tokens=False))
        if tail >= left:
            raise BadRequest(f"the suffix is {tail} tokens: with a fill before it, it does not fit the {left} "
                             f"positions the model's context of {self.context} leaves after the {len(ids)}-token "
                             "prompt", param="suffix", code="context_length_exceeded")
        room = left - tail
        if max_tokens is None:
            max_tokens = min(self.max_tokens, room)
        elif max_tokens > room:  # refused before the hole is built: it would take max_tokens positions
            raise BadRequest(f"max_tokens is {max_tokens}, but the model's context of {self.context} leaves room "
                             f"for at most {room} before the {tail}-token suffix after the {len(ids)}-token "
                             "prompt", param="max_tokens", code="context_length_exceeded")
        try:
            template = infill_template(self.tokenizer, suffix, max_tokens, canvas, left)
        except TemplateError as e:
            raise BadRequest(str(e), param="suffix") from None
        job.tail = self.tokenizer.decode(template.tokens[template.holes[0][1].size:])
        return template, len(template)

    # -- answering ---------------------------------------------------------------------------------

    def answer(self, event: Event, reply: Reply, content: str | None = None, reasoning: str | None = None) -> Answer:
        """The answer a finishing ``event`` ends (``content`` and ``reasoning``: the whole answer's, for
        a reply in one piece; the event's own in a stream), its tool calls parsed out."""
        content = event.content if content is None else content
        reasoning = event.reasoning if reasoning is None else reasoning
        calls, finish = [], event.finish_reason
        if len(reply.forced) == 1:
            calls, content = [(reply.forced[0], content)], ""
        elif reply.forced:
            try:
                call = chosen_call(content)
                calls, content = [(call.name, json.dumps(call.arguments))], ""
            except ValueError:  # (an answer the grammar cut short: its text stays, where the client can see it)
                pass
        elif reply.tools:
            try:
                content, parsed = parse_tool_calls(content)
                calls = [(c.name, json.dumps(c.arguments)) for c in parsed]
            except ValueError:  # a malformed call stays in the text, where the client can see it
                pass
        return Answer(content, reasoning, calls, "tool_calls" if calls else finish, event.usage, event.stop_sequence)

    async def _wholes(self, jobs: list[Job], queues: list[asyncio.Queue], reply: Reply,
                      request: Request) -> list[Answer]:
        """Each choice's whole answer; one that fails ends the others."""
        tasks = [asyncio.ensure_future(self._whole(job, events, reply, request)) for job, events in zip(jobs, queues)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for job, task in zip(jobs, tasks):
                job.cancel()
                task.cancel()
            raise

    async def _whole(self, job: Job, events: asyncio.Queue, reply: Reply, request: Request) -> Answer:
        content, reasoning, logprobs, prompt_logprobs = "", "", [], None
        async for event in job_events(events, request):
            if event.error is not None:
                raise BadRequest(str(event.error), param=event.error.param, status=event.error.status)
            content += event.content
            reasoning += event.reasoning
            logprobs += event.logprobs or []
            prompt_logprobs = event.prompt_logprobs or prompt_logprobs
            if event.finish_reason is not None:
                answer = self.answer(event, reply, content, reasoning)
                if job.logprobs is not None:
                    answer.logprobs, answer.prompt_logprobs = logprobs, prompt_logprobs
                    answer.sampled_from = event.sampled_from
                return answer
        job.cancel()
        raise BadRequest("the client went away", status=499)

    async def _streamed(self, api: Api, jobs: list[Job], queues: list[asyncio.Queue], reply: Reply,
                        request: Request):
        events = job_events(queues[0], request) if len(queues) == 1 else choice_events(queues, request)
        try:
            async for chunk in api.stream(events, reply):
                yield chunk
        finally:  # the client went away mid-answer (a finished job's cancel changes nothing)
            for job in jobs:
                job.cancel()

    async def text_pieces(self, events: AsyncIterator[Event], reply: Reply):
        """A stream's answer as its text pieces (the thought's as ``Thought`` pieces, before the text of
        the same event), then its ``Answer`` (tool calls parsed out of the text held back to the end,
        which its last piece was), or the ``RequestFailed`` that ended it."""
        async for event in events:
            if event.error is not None:
                yield event.error
                return
            if event.reasoning:
                yield Thought(event.reasoning)
            if event.finish_reason is None:
                if event.content:
                    yield event.content
                continue
            last = self.answer(event, reply)
            if last.content:
                yield last.content
            yield last


class Thought(str):
    """A piece of a stream's thought (``Server.text_pieces``)."""
