"""A chat or completions body read once, field by field, into a typed ``RequestBody`` (``Reader.read``),
then made into the worker's jobs (``Reader.jobs``): the prompt through the chat template, images
opened and decoded, the answer's layout asked for, and every job resolved (engine/resolve.py) here, on
the server's preparing threads, so that anything wrong is a 400 before the worker sees it. ``n``
choices of a request are jobs at seed, seed + 1, ...; a completions request's prompt array takes
several. The fields the server refuses unless they are off are refused here by name.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import secrets
from dataclasses import dataclass

from .. import validate
from ..chat_template import RenderLimit, RenderLimitError
from ..engine.resolve import answer_room, check_prompt_fits, generation_config, resolve
from ..errors import PromptError
from ..model.images import Frame, ImageError, ImageInputs, decode_image, image_inputs, open_image_url
from ..model.video import Clip, place_videos, video_from_url, video_processor
from ..model.vision import check_takes_images, has_vision
from ..options import GenerationArgs
from ..structured.grammar import JSON_OBJECT
from ..structured.template import CanvasTemplate, TemplateError, infill_template
from ..structured.tool_calls import CALL_OPEN, call_choice_schema, check_parameters, check_tool, in_tool_terms
from ..validate import shown
from . import reasoning
from .api import MAX_STOP_STRINGS, BadRequest, Reply
from .body import strings, typed
from .logprobs import logprobs
from .scheduler import Job, failure
from .settings import request_options

MAX_CHOICES = 8  # n: the choices of one request, each a row of the worker's batch
MAX_PROMPTS = 64  # a completions request's prompts, times n: its choices (each a row of the engine's batch)
# A message's role as the chat template takes it: OpenAI's developer messages are system ones.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
# OpenAI parameters this server does not honour, each with the value that leaves it off: clients
# send those defaults, so they are accepted; anything else is refused by name. (user, metadata,
# store, service_tier and parallel_tool_calls change nothing here and are accepted as they come.)
UNSUPPORTED = {
    "best_of": 1,
    "logit_bias": {},
    "suffix": "",
    "functions": [],
    "function_call": "none",
    "modalities": ["text"],
    "audio": None,
    "prediction": None,
    "web_search_options": None,
}


@dataclass(frozen=True)
class AskedLayout:
    """A request's layout fields read: its ``template`` text or JSON ``schema`` (or neither), the body
    field a refusal of it names, and whether a draft of it may come as a tool call (a forced call)."""

    template: str | None = None
    schema: object = None
    param: str = "response_format"
    reads_call: bool = False

    @property
    def given(self) -> bool:
        return self.template is not None or self.schema is not None


@dataclass(frozen=True)
class RequestBody:
    """A chat (``chat``) or completions body, every field read and checked once."""

    body: dict  # as translated (OpenAI's): its messages or prompt, read as the prompt is built
    chat: bool
    stream: bool
    n: int
    include_usage: bool
    max_key: str  # max_tokens, or chat's max_completion_tokens
    max_tokens: int | None
    logprobs: int | None  # most likely tokens per position (None: no log-probabilities)
    echo: bool
    stop: list[str]
    options: dict  # the generation options (settings.py), the server's defaults under the request's
    tools: list[dict]
    forced: list[dict] | None  # the tools a call is forced to (one of)
    suffix: str | None  # a completion's suffix: the middle is filled
    layout: AskedLayout
    think: bool
    cap_max_tokens: bool  # max_tokens is a cap, cut to what the context leaves (Ollama's num_predict)


class Reader:
    """Reads requests for ``model`` (the server's ``options`` are the defaults a request may override;
    ``chat_template_args`` go to the chat template with every request)."""

    def __init__(
        self,
        model,
        tokenizer,
        model_id: str,
        limits,
        options: dict | None = None,
        chat_template_args: dict | None = None,
    ):
        self.model, self.tokenizer, self.model_id, self.limits = model, tokenizer, model_id, limits
        self.defaults = generation_config(model, tokenizer)
        self.options = request_options(options or {}, self.defaults, model.config.canvas_length, limits.max_steps)
        self.chat_template_args = chat_template_args or {}
        self.max_tokens = limits.max_tokens or self.defaults.max_new_tokens
        self.context = model.config.max_position_embeddings
        # No token is longer than the vocabulary's longest: text longer than that many per position
        # cannot fit the context, and is refused before it is rendered or tokenized.
        self.max_text_chars = self.context * max(
            [len(tokenizer.piece(i)) for i in range(model.config.vocab_size)] if tokenizer.has_vocabulary else [1]
        )
        # The chat template's render: its seconds, and no string in it longer than a prompt may be.
        self.render_limit = RenderLimit(chars=self.max_text_chars)

    def read(
        self, body: dict, chat: bool, max_stop: int = MAX_STOP_STRINGS, cap_max_tokens: bool = False
    ) -> RequestBody:
        """``body``'s fields, each of its type and within its bounds (a 400 naming the first that is not)."""
        check_supported(body, chat)
        self.check_model(body.get("model"))
        stream = typed(body, "stream", bool, False)
        n = typed(body, "n", int, 1)
        if not 1 <= n <= MAX_CHOICES:
            raise BadRequest(
                f"n must be from 1 to {MAX_CHOICES}, the choices this server runs for one request, got {n}", param="n"
            )
        stream_options = typed(body, "stream_options", dict, None) or {}
        max_key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = typed(body, max_key, int, None)
        top, echo = logprobs(body, chat)
        if max_tokens is not None and max_tokens < (0 if echo else 1):
            scored = "" if chat else " (0 with echo true: the prompt alone)"
            raise BadRequest(f"{max_key} must be at least 1{scored}, got {validate.shown(max_tokens)}", param=max_key)
        stop = typed(body, "stop", (str, list), None) or []
        stop = [stop] if isinstance(stop, str) else stop
        if len(stop) > max_stop or not all(isinstance(s, str) and s for s in stop):
            raise BadRequest(f"stop must be a non-empty string or a list of at most {max_stop}", param="stop")
        options = {
            **self.options,
            **request_options(body, self.defaults, self.model.config.canvas_length, self.limits.max_steps),
        }
        tools, forced = self._tools(body) if chat else ([], None)
        suffix = None if chat else typed(body, "suffix", str, None) or None
        layout = self._layout(body, forced)
        if suffix is not None and layout.given:
            raise BadRequest("give one of suffix, template and response_format", param="suffix")
        # A JSON answer (a schema, json_object, a forced call) starts at once: no thought before it.
        think = (
            reasoning.thinks(
                body, chat, self.tokenizer.renders_thinking, self.chat_template_args.get("enable_thinking", False)
            )
            and layout.schema is None
        )
        return RequestBody(
            body,
            chat,
            stream,
            n,
            bool(stream_options.get("include_usage")),
            max_key,
            max_tokens,
            top,
            echo,
            stop,
            options,
            tools,
            forced,
            suffix,
            layout,
            think,
            cap_max_tokens,
        )

    def jobs(self, request: RequestBody) -> tuple[list[Job], Reply]:
        """The request's jobs, one per choice (``n``), resolved, and how to shape their answers."""
        body, chat, forced, layout = request.body, request.chat, request.forced, request.layout
        tools = request.tools if request.tools and not forced else None
        ids, vision_inputs = (
            self._chat_prompt(body, tools, request.think)
            if chat
            else (self._text_prompt(body, empty=request.suffix is not None), {})
        )
        job = Job(
            ids,
            GenerationArgs(),
            stop=[] if layout.given else request.stop,  # (stops never cut a layout)
            hold=[CALL_OPEN] if tools else [],
            whole=forced is not None,
            prompt_param="messages" if chat else "prompt",
            template_param=layout.param if layout.given else None,
            max_tokens_param=request.max_key,
            think=request.think,
            logprobs=request.logprobs,
            echo=request.echo,
            stream=request.stream,
        )
        reply = Reply(
            chat,
            request.stream,
            request.include_usage,
            bool(tools),
            tuple(t["function"]["name"] for t in forced or ()),
            id=f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}",
            prompt_tokens=len(ids),
            n=request.n,
            logprobs=request.logprobs is not None,
            echoes=[self._echo(body, ids)] * request.n if request.echo else None,
        )
        max_tokens, template = request.max_tokens, layout.template
        if (
            max_tokens == 0
        ):  # the prompt scored, nothing generated (a stop, a suffix or a layout has no answer to shape)
            self.check_ids(ids, job.prompt_param)
            job.args = GenerationArgs.of(**request.options, max_tokens=0)
            return choices(job, request.n), reply
        if request.suffix is not None:
            template, max_tokens = self._infill(job, request.suffix, max_tokens)
        elif request.cap_max_tokens and max_tokens is not None:
            max_tokens = min(max_tokens, answer_room(ids, self.model.config))
        job.args = GenerationArgs.of(
            **request.options,
            max_tokens=max_tokens,
            template=template,
            schema=layout.schema,
            images=ImageInputs(vision_inputs) if vision_inputs else None,
        )
        try:  # everything about the request that needs no device, checked once: the worker plans it
            job.resolved = resolve(
                self.model, self.tokenizer, ids, job.args, self.max_tokens, layout.reads_call, request.max_key
            )
        except ValueError as e:
            refused = failure(job, e, bad_input=ValueError)
            of_tools = forced is not None and refused.param == "tools"  # (a forced call's schema)
            raise BadRequest(
                in_tool_terms(str(refused), forced) if of_tools else str(refused),
                param=refused.param,
                code="context_length_exceeded" if getattr(e, "context", False) else None,
            ) from None
        return choices(job, request.n), reply

    def count(self, body: dict) -> int:
        """The prompt tokens of a chat ``body`` (its messages and tools through the chat template)."""
        self.check_model(body.get("model"))
        tools, forced = self._tools(body)
        return len(self.check_ids(self._chat_prompt(body, tools if tools and not forced else None)[0], "messages"))

    def check_model(self, model) -> None:
        """A request for this server's model (or for none, or "default_model")."""
        if model not in (None, self.model_id, "default_model"):
            raise BadRequest(
                f"the model {validate.shown_json(model, 80)} does not exist; this server serves '{self.model_id}'",
                param="model",
                code="model_not_found",
                status=404,
            )

    def check_length(self, chars: int, what: str, param: str, at_least: bool = False) -> None:
        """Refuse text that cannot fit the context before it is rendered or tokenized (``at_least``: a
        render stopped at ``chars``)."""
        if chars > self.max_text_chars:
            raise BadRequest(
                f"{what} is {'at least ' * at_least}{chars} characters: more than the model's context of {self.context} "
                f"tokens can hold (at most {self.max_text_chars})",
                param=param,
                code="context_length_exceeded",
            )

    def check_ids(self, ids: list[int], param: str) -> list[int]:
        """A prompt of ids the model can take and answer within its context, for a request that is not
        resolved (a prompt scored alone, tokens counted)."""
        config = self.model.config
        try:
            check_prompt_fits(ids, config)
        except PromptError as e:
            raise BadRequest(str(e), param=param, code="context_length_exceeded" if e.context else None) from None
        return ids

    def _layout(self, body: dict, forced: list[dict] | None) -> AskedLayout:
        """The layout ``body`` asks for: ``template``, ``response_format`` or a call forced to one of ``forced``."""
        text = typed(body, "template", str, None)
        response_format = typed(body, "response_format", dict, None) or {"type": "text"}
        kind = response_format.get("type")
        if sum(x is not None for x in (text, forced, None if kind == "text" else kind)) > 1:
            raise BadRequest("give one of template, response_format and a forced tool call", param="response_format")
        if kind not in ("text", "json_object", "json_schema"):
            raise BadRequest(
                f"response_format type must be text, json_object or json_schema, got {shown(kind)}",
                param="response_format",
            )
        if text is not None:
            self.check_length(len(text), "the template", "template")
            return AskedLayout(template=text, param="template")
        if forced is not None:
            try:
                for tool in forced:
                    check_tool(tool)
            except TemplateError as e:
                raise BadRequest(str(e), param="tools") from None
            schema = (
                forced[0]["function"].get("parameters") or {"type": "object", "properties": {}}
                if len(forced) == 1
                else call_choice_schema(forced)
            )
            self.check_length(sum(map(len, strings(schema))), "the tool's parameters", "tools")
            return AskedLayout(schema=schema, param="tools", reads_call=True)
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, (dict, bool)):
                raise BadRequest(
                    'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                    param="response_format",
                )
            self.check_length(sum(map(len, strings(schema))), "the schema's text", "response_format")
            return AskedLayout(schema=schema)
        if kind == "json_object":
            return AskedLayout(schema=JSON_OBJECT)
        return AskedLayout()

    def _tools(self, body: dict) -> tuple[list[dict], dict | None]:
        """The request's tools (none with tool_choice "none") and those a forced call is to (one of them:
        tool_choice "required", or the one it names), or None."""
        tools = typed(body, "tools", list, None) or []
        for tool in tools:
            function = tool.get("function") if isinstance(tool, dict) else None
            if not (
                isinstance(function, dict)
                and tool.get("type") == "function"
                and isinstance(function.get("name"), str)
                and isinstance(function.get("parameters", {}), (dict, type(None)))
            ):
                raise BadRequest(
                    'each tool must be {"type": "function", "function": {"name": ..., "parameters": {a JSON schema}}}',
                    param="tools",
                )
            try:
                check_parameters(function)
            except TemplateError as e:
                raise BadRequest(str(e), param="tools") from None
        names = collections.Counter(tool["function"]["name"] for tool in tools)
        if twice := [name for name, count in names.items() if count > 1]:
            raise BadRequest(
                f"tools holds {names[twice[0]]} tools named {shown(twice[0])}; each tool needs a name of its own "
                "(a call names the tool it is to)",
                param="tools",
            )
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
            raise BadRequest(
                f"tool_choice must be 'none', 'auto', 'required' or name one of the tools, "
                f"got {validate.shown(choice)}",
                param="tool_choice",
            )
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
            if (role := ROLES.get(message["role"])) is None:
                raise BadRequest(
                    f"messages[{i}].role {shown(message['role'])} is not a role; use one of {', '.join(ROLES)}",
                    param="messages",
                )
            content, pictures = self._content(message.get("content"), i, len(images))
            plain.append({**message, "role": role, "content": content})
            images += pictures
        # Only text the template renders counts: the images are out of it by now (their data URLs are no
        # text for the template), and so are tools where the template writes none (the demo's; clients
        # such as Open WebUI send dozens with every chat).
        tools = tools if tools and self.tokenizer.renders_tools else None
        self.check_length(
            sum(map(len, strings([plain, tools]))),
            "the text of the messages and tools" if tools else "the text of the messages",
            "messages",
        )
        clips = [clip for clip in images if isinstance(clip, Clip)]
        images = [image for image in images if not isinstance(image, Clip)]
        if (pixels := sum(image.width * image.height for image in images)) > self.limits.max_image_pixels:
            raise BadRequest(
                f"the request's images are {pixels} pixels together, more than the "
                f"{self.limits.max_image_pixels} accepted; scale them down",
                param="messages",
            )
        extra = {"tools": tools} if tools else {}
        try:  # (enable_thinking given either way: a template whose default is on is off unless asked)
            text = self.tokenizer.apply_chat_template(
                plain,
                add_generation_prompt=True,
                tokenize=False,
                render_limit=self.render_limit,
                **{**self.chat_template_args, "enable_thinking": think},
                **extra,
            )
        except RenderLimitError as e:  # its deadline, or a text past what the context can hold
            self.check_length(e.size or 0, "the prompt the chat template renders", "messages", at_least=True)
            raise BadRequest(f"the chat template cannot render these messages: {e}", param="messages") from None
        except Exception as e:  # the template's own raise_exception, or messages it cannot render
            raise BadRequest(f"the chat template cannot render these messages: {e}", param="messages") from None
        self.check_length(len(text), "the prompt the chat template renders", "messages")  # before tokenizing it
        if clips:  # each video placeholder the template wrote becomes its frames, laid out as images
            try:
                text, images = place_videos(text, images, clips, video_processor(self.model))
            except ImageError as e:
                raise BadRequest(f"messages: {e}", param="messages") from None
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        vision_inputs = {}
        if images:
            if (placed := ids.count(self.model.config.image_token_id)) != len(images):
                raise BadRequest(
                    f"the chat template wrote {placed} image placeholders for {len(images)} images (a "
                    "template that takes no image parts, or drops them from some messages)",
                    param="messages",
                )
            try:  # each placeholder the template wrote becomes its image's soft tokens
                pictures = [image if isinstance(image, Frame) else decode_image(image) for image in images]
                ids, vision_inputs = image_inputs(self.model, ids, pictures)
            except ImageError as e:
                raise BadRequest(f"messages: {e}", param="messages") from None
        return ids, vision_inputs

    def _content(self, content, index: int, earlier_images: int) -> tuple[str | list[dict], list]:
        """A message's content for the chat template (its text, or text, image and video parts) and its
        images, opened (their headers read, ``open_image_url``), and videos, decoded (``video.Clip``s)."""
        if content is None:
            return "", []
        if isinstance(content, str):
            return content, []
        if not (isinstance(content, list) and all(isinstance(p, dict) for p in content)):
            raise BadRequest(
                f"messages[{index}].content must be a string or a list of text, image_url and video_url parts",
                param="messages",
            )
        if kinds := {t[:40] if isinstance(t := p.get("type"), str) else validate.shown_json(t) for p in content} - {
            "text",
            "image_url",
            "video_url",
        }:
            raise BadRequest(
                f"messages[{index}]: content of type {min(map(str, kinds))} is not supported; "
                "send text, image_url or video_url",
                param="messages",
            )
        if all(p.get("type") == "text" for p in content):
            return "".join(str(p.get("text", "")) for p in content), []
        if not has_vision(self.model):
            what = "an image" if any(p.get("type") == "image_url" for p in content) else "a video"
            raise BadRequest(
                f"messages[{index}] has {what}, but this model takes text only (no vision tower)", param="messages"
            )
        if (count := earlier_images + sum(p.get("type") != "text" for p in content)) > self.limits.max_images:
            raise BadRequest(
                f"the request has {count} or more images, more than the {self.limits.max_images} accepted",
                param="messages",
            )
        parts, images = [], []
        for part in content:
            if part.get("type") == "text":
                parts.append({"type": "text", "text": str(part.get("text", ""))})
                continue
            kind = part["type"]
            url = part.get(kind)
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                media = "video/mp4" if kind == "video_url" else "image/png"
                raise BadRequest(
                    f'messages[{index}]: an {kind} part must be {{"type": "{kind}", '
                    f'"{kind}": {{"url": "data:{media};base64,..."}}}}',
                    param="messages",
                )
            try:
                if kind == "video_url":
                    check_takes_images(self.model, "video")  # (before the clip is decoded)
                    images.append(video_from_url(url, self.limits.image_dir, video_processor(self.model)))
                else:
                    images.append(open_image_url(url, self.limits.image_dir))
            except ImageError as e:
                raise BadRequest(f"messages[{index}]: {e}", param="messages") from None
            parts.append({"type": "video" if kind == "video_url" else "image"})
        return parts, images

    def _text_prompt(self, body: dict, empty: bool = False) -> list[int]:
        """The prompt's ids (an infill's prefix may be ``empty``)."""
        prompt = body.get("prompt", "" if empty else None)
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str) and (prompt or empty):
            self.check_length(len(prompt), "the prompt", "prompt")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            return prompt
        raise BadRequest("prompt must be a non-empty string or a list of token ids", param="prompt")

    def _echo(self, body: dict, ids: list[int]) -> str:
        """The text echoed before a completion: the prompt as sent, or its ids' text."""
        prompt = body.get("prompt")
        prompt = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str) else prompt
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)

    def _infill(self, job: Job, suffix: str, max_tokens: int | None) -> tuple[CanvasTemplate, int]:
        """The prompt is the prefix: the answer is a hole of at least ``max_tokens`` (by default the
        server's, cut to what the context leaves next to the suffix), then the suffix clamped at the end
        of its last canvas; the worker takes the suffix off the answer (``Job.tail``). A hole is
        generated whole, so ``max_tokens`` is no cap here, even for an API whose limit is one (Ollama's
        ``num_predict``): more than the context leaves is refused, not a hole the size of the context."""
        self.check_length(len(suffix), "the suffix", "suffix")
        ids, canvas = job.ids, self.model.config.canvas_length
        left = (self.context - len(ids)) // canvas * canvas  # whole canvases after the prompt
        tail = len(self.tokenizer.encode(suffix, add_special_tokens=False))
        if tail >= left:
            raise BadRequest(
                f"the suffix is {tail} tokens: with a fill before it, it does not fit the {left} "
                f"positions the model's context of {self.context} leaves after the {len(ids)}-token "
                "prompt",
                param="suffix",
                code="context_length_exceeded",
            )
        room = left - tail
        if max_tokens is None:
            max_tokens = min(self.max_tokens, room)
        elif max_tokens > room:  # refused before the hole is built: it would take max_tokens positions
            raise BadRequest(
                f"max_tokens is {max_tokens}, but the model's context of {self.context} leaves room "
                f"for at most {room} before the {tail}-token suffix after the {len(ids)}-token "
                "prompt",
                param="max_tokens",
                code="context_length_exceeded",
            )
        try:
            template = infill_template(self.tokenizer, suffix, max_tokens, canvas, left)
        except TemplateError as e:
            raise BadRequest(str(e), param="suffix") from None
        job.tail = self.tokenizer.decode(template.tokens[template.holes[0][1].size :])
        return template, len(template)


def choices(job: Job, n: int) -> list[Job]:
    """``job`` and its ``n`` - 1 other choices."""
    return [job, *(choice(job, i) for i in range(1, n))]


def choice(job: Job, index: int) -> Job:
    """Choice ``index`` of a request with ``n`` > 1: its first choice's job at seed + ``index`` (modulo
    2**64), or unseeded as the first is; so each choice is the answer the request alone gets at that seed."""
    seed = job.args.seed
    args = dataclasses.replace(job.args, seed=None if seed is None else (seed + index) % validate.SEED_LIMIT)
    resolved = None if job.resolved is None else dataclasses.replace(job.resolved, args=args)
    return dataclasses.replace(job, args=args, resolved=resolved)


def prompts(body: dict) -> list:
    """A completions request's prompts: a string, a list of token ids, or a list of either (one choice
    each, at most ``MAX_PROMPTS``); a list of one string is that string."""
    prompt = body.get("prompt")
    if not (isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt)):
        return [prompt]
    if len(prompt) > MAX_PROMPTS:
        raise BadRequest(
            f"prompt holds {len(prompt)} prompts, more than the {MAX_PROMPTS} one request takes; "
            "send them in several requests",
            param="prompt",
        )
    return prompt


def check_supported(body: dict, chat: bool) -> None:
    for key, off in UNSUPPORTED.items():
        value = body.get(key)
        if key == "suffix" and not chat:  # completions fill the middle
            continue
        if value is not None and not (value == off and isinstance(value, bool) == isinstance(off, bool)):
            leave = "leave it out" if off is None else f"leave it out or send {json.dumps(off)}"
            raise BadRequest(f"{key} is not supported by this server; {leave}", param=key)
