"""The HTTP side on starlette: one request model under every API the server speaks.

Every endpoint is an ``Api`` (api.py): a translation of its JSON into the chat or completions body read
here (OpenAI's, so every API shares the same checks, templates, tool parsing, limits and streaming), and
of the answer back into its own shape (openai_api.py, ollama.py, responses.py and anthropic.py).
A body is read here up to its size limit; jobs.py reads its fields and makes it the worker's jobs,
resolved (the model, every setting, the prompt against the context, the template or schema, the
images), so anything wrong gets OpenAI's error shape with a 4xx status before the worker sees it.
Everything past reading the body (parsing its JSON, rendering, tokenizing, building templates,
decoding images) runs on a small thread pool, each part bounded by a limit checked before it starts
(docs/server.md, "Limits and hostile input"): the event loop stays free to answer.
The worker's events come back as one JSON reply or as server-sent events, a chunk per committed canvas.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import warnings
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from .. import validate
from ..structured.tool_calls import chosen_call, parse_tool_calls
from . import request_log
from .api import Answer, Api, BadRequest, Reply, error_response
from .body import check_unicode, json_reply, parsed
from .events import choice_events, job_events, next_event
from .heap import TRIM_AFTER_LOGPROBS, give_back_freed
from .jobs import MAX_PROMPTS, Reader, prompts as prompts_of
from .logprobs import check_reply_logprobs
from .scheduler import EmbeddingJob, Event, Job, Scheduler

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

    def __init__(
        self,
        model,
        tokenizer,
        model_id: str,
        scheduler: Scheduler,
        limits: Limits = Limits(),
        options: dict | None = None,
        chat_template_args: dict | None = None,
    ):
        """``options``: the generation options a request that does not set them gets (by body field name,
        the server's --temp, --top-p...: checked as a request's are, a ``BadRequest`` naming the field);
        ``chat_template_args``: the chat template's arguments for every request (``enable_thinking``:
        thinking on unless a request turns it off)."""
        from PIL.Image import DecompressionBombWarning

        self.model, self.tokenizer, self.model_id, self.scheduler = model, tokenizer, model_id, scheduler
        self.limits = limits
        self.reader = Reader(model, tokenizer, model_id, limits, options, chat_template_args)
        self.context = self.reader.context
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
        return JSONResponse({"object": "list", "data": [self._model_entry()]})

    async def retrieve_model(self, request: Request):
        """OpenAI's retrieve: the model served, by its id (ids may hold a slash: org/name)."""
        name = request.path_params["model"]
        if name != self.model_id:
            return error_response(
                f"the model {name[:200]!r} is not served here; this server serves {self.model_id!r}",
                404,
                param="model",
                code="model_not_found",
            )
        return JSONResponse(self._model_entry())

    def _model_entry(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "mlx-dgemma"}

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
                return StreamingResponse(
                    self._streamed(api, jobs, queues, reply, request),
                    media_type=api.stream_type,
                    headers={"Cache-Control": "no-cache"},
                )
            answers = await self._wholes(jobs, queues, reply, request)
            response = await self.off_loop(lambda: json_reply(api.replies(answers, reply)))
            if reply.held_logprobs >= TRIM_AFTER_LOGPROBS:  # once sent, what it held goes back to the system
                del answers
                response.background = BackgroundTask(self.off_loop, give_back_freed)
            return response
        except BadRequest as e:
            return self._refused(number, request, api, e)

    async def count_tokens(self, request: Request, api: Api) -> Response:
        """The prompt tokens ``request``'s body would be answered from (its messages and tools through
        the chat template), as ``{"input_tokens": n}``; errors in ``api``'s shape."""
        return await self.worked(request, api, lambda body: {"input_tokens": self._count(api, body)})

    def _count(self, api: Api, body: dict) -> int:
        check_unicode(body)  # (by the field the client sent)
        body, _ = api.translate(body)
        api.translated = True  # (errors from here on use the API's names)
        return self.reader.count(body)

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

    def _prepare(self, api: Api, body: dict) -> tuple[list[Job], Reply] | None:
        """The request's jobs (``n`` choices of each prompt, a completions request's prompt array taking
        several, in order) and its reply."""
        check_unicode(body)  # (by the field the client sent)
        translated = api.translate(body)
        api.translated = True
        if translated is None:
            return None
        body, chat = translated
        prompts = [None] if chat else prompts_of(body)
        jobs, echoes = [], []
        for i, prompt in enumerate(prompts):
            try:
                read = self.reader.read(
                    body if chat else {**body, "prompt": prompt}, chat, api.max_stop, api.caps_max_tokens
                )
                choices, reply = self.reader.jobs(read)
            except BadRequest as e:
                if len(prompts) == 1 or e.param != "prompt":
                    raise
                raise BadRequest(f"prompt[{i}]: {e}", "prompt", e.code, e.status) from None
            if len(jobs) + len(choices) > MAX_PROMPTS:
                raise BadRequest(
                    f"{len(prompts)} prompts of n {reply.n} choices each are more than the {MAX_PROMPTS} "
                    "choices one request takes; send fewer prompts or a smaller n",
                    param="n",
                )
            jobs += choices
            echoes += reply.echoes or []
        reply.held_logprobs = check_reply_logprobs(jobs)
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
        too_big = BadRequest(
            f"the request body is over the server's limit of {limit} bytes; send less, or "
            "start the server with a larger --max-request-bytes",
            code="request_too_large",
            status=413,
        )
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise too_big
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_big
        return await self.off_loop(parsed, body, number, request.url.path)

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

    async def _wholes(
        self, jobs: list[Job], queues: list[asyncio.Queue], reply: Reply, request: Request
    ) -> list[Answer]:
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

    async def _streamed(self, api: Api, jobs: list[Job], queues: list[asyncio.Queue], reply: Reply, request: Request):
        events = job_events(queues[0], request) if len(queues) == 1 else choice_events(queues, request)
        try:
            async for chunk in api.stream(events, reply):
                yield chunk
        finally:  # the client went away mid-answer (a finished job's cancel changes nothing)
            _cancel(jobs)
            if reply.held_logprobs >= TRIM_AFTER_LOGPROBS:  # what the stream held goes back to the system
                jobs.clear()
                await self.off_loop(give_back_freed)

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


def _cancel(jobs: list[Job]) -> None:
    for job in jobs:
        job.cancel()
