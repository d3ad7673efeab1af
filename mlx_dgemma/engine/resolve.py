"""A request resolved: ``resolve`` checks one and settles everything about it that needs no device
(the prompt's ids and images, the answer's layout, its budget against the context, the template's and
the schema's closing checks, the stop ids), from one ``options.GenerationArgs``. It runs where a
request arrives: the API and the command line call it, the server on its preparing threads, once per
request. ``request.plan`` then makes the device-bound part (the profile, the plan, the draws).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from os import PathLike

from ..errors import PromptError, TemplateError
from ..model.config import GenerationConfig
from ..model.images import ImageInputs, image_inputs
from ..model.video import VIDEO_PLACEHOLDER, load_video, place_videos, video_processor
from ..model.vision import check_takes_images
from ..options import GenerationArgs, check_prefill_step_size
from ..structured.closing import check_closing_fits, check_closing_room, closing_length
from ..structured.layout import Layout, answer_layout
from ..structured.template import CanvasTemplate
from ..tokenizer import TextStream, Tokenizer
from ..validate import check_request, check_steps, integer_in
from .scoring import MAX_TOP_LOGPROBS

SCHEMA_ROOM = 4  # a schema's answer by default has room for this many times its shortest one


@dataclass(frozen=True)
class ResolvedRequest:
    """One request with everything settled that needs no device; ``request.plan`` makes it ready."""

    ids: list[int]  # the prompt's, images' soft tokens expanded
    args: GenerationArgs
    max_tokens: int  # the answer's budget (a template's own length; a drafted schema's: the draft's)
    defaults: GenerationConfig
    overrides: dict  # the caller's sampler settings, applied to every plan (auto re-plans)
    layout: Layout
    stop_ids: frozenset[int]
    end_of_turn: int | None
    vision_inputs: dict  # images as model.encode takes them (empty without images)

    @property
    def template(self) -> CanvasTemplate | None:
        """The template the answer is generated on (a drafted layout's comes after its draft)."""
        return self.layout.template if self.layout.kind == "template" else None

    def text_decoder(self, tokenizer: Tokenizer):
        """A fresh decoder of the answer's committed tokens (``.add(ids, final)``): the clean text, or a
        template's answer (whole with the last piece)."""
        template = self.template
        if template is None:
            return TextStream(tokenizer, set(self.stop_ids))
        return _TemplateText(tokenizer, template, set(self.stop_ids), self.end_of_turn)

    def answered(self, tokenizer: Tokenizer, draft: str) -> ResolvedRequest:
        """A drafted request's answer: the schema's template sized by the ``draft``'s text."""
        layout = self.layout.sized(draft)
        template = layout.template
        end = end_of_turn(tokenizer, self.defaults) if template.ends_turn else None
        return replace(self, layout=layout, max_tokens=len(template) + template.ends_turn, end_of_turn=end)


def resolve(
    model,
    tokenizer: Tokenizer,
    prompt: str | list[int],
    args: GenerationArgs,
    default_max_tokens: int | None = None,
    reads_call: bool = False,
    budget_name: str = "max_tokens",
) -> ResolvedRequest:
    """Check a request and settle everything about it that needs no device (see ``api.stream_generate``).
    ``default_max_tokens`` is the budget of a request that gives none (None: the checkpoint's
    ``max_new_tokens``), cut to what the context leaves; ``reads_call``: a drafted schema's draft may be
    a tool call (a forced call's); ``budget_name`` is the caller's name for ``max_tokens`` in messages."""
    config = model.config
    defaults = generation_config(model, tokenizer)
    prompt = check_request(
        prompt,
        defaults.max_new_tokens if args.max_tokens is None else args.max_tokens,
        args.seed,
        args.system_prompt,
        args.chat_template,
    )
    layout = answer_layout(
        tokenizer,
        config.vocab_size,
        grammar_stop_ids(tokenizer, defaults),
        template=args.template,
        schema=args.schema,
        policy=args.policy,
        limit=config.max_position_embeddings,
        max_tokens=args.max_tokens,
        reads_call=reads_call,
    )
    template = layout.template if layout.kind == "template" else None
    end = end_of_turn(tokenizer, defaults) if template is None or template.ends_turn else None
    overrides = args.sampling.overrides(defaults)  # they replace the plan's, and none is dropped
    check_step_counts(overrides.get("steps"), args.draft_steps)
    check_prefill_step_size(args.prefill_step_size, "prefill_step_size")
    if args.logprobs is not None:
        integer_in(0, MAX_TOP_LOGPROBS)(args.logprobs, "logprobs")
    if args.kv_quantization is not None:
        args.kv_quantization.check([config.layer_head_dim(i) for i in range(config.num_hidden_layers)])
    if args.think and layout.json:
        raise ValueError(
            "a JSON answer is laid out from its first token and leaves no room for a thought; drop think or the schema"
        )
    ids, vision_inputs = _prompt_and_images(model, tokenizer, prompt, args)
    grammar, room = layout.grammar, answer_room(ids, config)
    if template is not None:
        max_tokens = len(template) + template.ends_turn
    elif args.max_tokens is not None:
        max_tokens = args.max_tokens
    else:
        shortest = closing_length(grammar, config.vocab_size) if grammar is not None else 0
        max_tokens = min(max(default_max_tokens or defaults.max_new_tokens, SCHEMA_ROOM * shortest), room)
    check_prompt_fits(ids, config, max_tokens if template is None else 1, budget_name)
    if grammar is not None:
        check_closing_room(grammar, config.vocab_size, room)
        check_closing_fits(grammar, config.vocab_size, max_tokens)
    if layout.template is not None:  # a template, or the largest a draft may size
        check_template_fits(layout.template, len(ids), config)
    return ResolvedRequest(
        ids, args, max_tokens, defaults, overrides, layout, frozenset(defaults.eos_token_id), end, vision_inputs
    )


def generation_config(model, tokenizer: Tokenizer) -> GenerationConfig:
    """The checkpoint's generation_config.json (defaults for everything the caller leaves unset)."""
    return (
        getattr(model, "generation_config", None)
        or getattr(tokenizer, "generation_config", None)
        or GenerationConfig.from_dict({}, model.config)
    )


def prompt_ids(
    tokenizer: Tokenizer,
    prompt: str | list[int],
    system_prompt: str | None = None,
    chat_template: bool = True,
    images: int = 0,
    think: bool = False,
    videos: int = 0,
    place=None,
) -> list[int]:
    """Token ids as given, or text through the chat template (or plain, with ``<bos>``); with
    ``images`` and ``videos``, the user message starts with that many image, then video placeholders;
    ``think`` is the template's thinking switch (``enable_thinking``). ``place`` rewrites the ids or
    the text before it is tokenized (``video.place_videos``)."""
    place = place or (lambda given: given)
    if not isinstance(prompt, str):
        return place([int(i) for i in prompt])
    if not chat_template:
        return tokenizer.encode(place(prompt))
    if tokenizer.carries_chat_template(prompt):  # apply_chat_template's text: taken as given, as ids are
        if system_prompt is not None:
            raise PromptError(
                "the prompt already carries the chat template; write the system turn into it, "
                "or pass the untemplated text with the system prompt"
            )
        return tokenizer.encode(place(prompt))
    if think and not tokenizer.renders_thinking:
        raise PromptError(
            "this checkpoint's chat template has no thinking switch (enable_thinking); "
            "drop think, or pass a prompt that opens the thought as token ids"
        )
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    parts = [{"type": "image"}] * images + [{"type": "video"}] * videos
    messages.append({"role": "user", "content": parts + [{"type": "text", "text": prompt}] if parts else prompt})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, enable_thinking=think)
    return tokenizer.encode(place(text), add_special_tokens=False)


def check_prompt_fits(ids: list[int], config, max_tokens: int = 1, name: str = "max_tokens") -> None:
    """Ids in the vocabulary, and room in the context for them and every canvas ``max_tokens`` (the
    caller's ``name`` for it) takes."""
    if not ids:
        raise PromptError("the prompt is empty")
    if bad := [i for i in ids if not 0 <= i < config.vocab_size]:
        raise PromptError(f"prompt token id {bad[0]} is outside the vocabulary (0..{config.vocab_size - 1})")
    context, canvas = config.max_position_embeddings, config.canvas_length
    if len(ids) + canvas > context:
        raise PromptError(
            f"the prompt is {len(ids)} tokens: with a {canvas}-token canvas after it, "
            f"it does not fit the model's context of {context} tokens",
            context=True,
        )
    canvases = -(-max_tokens // canvas)
    if len(ids) + canvases * canvas > context:
        raise PromptError(
            f"{name} of {max_tokens} takes {canvases} canvases of {canvas} after the {len(ids)}-token "
            f"prompt, past the model's context of {context} tokens; ask for at most "
            f"{answer_room(ids, config)}",
            option="max_tokens",
            context=True,
        )


def answer_room(ids: list[int], config) -> int:
    """The most tokens an answer may take after ``ids``: the whole canvases the context leaves."""
    return (config.max_position_embeddings - len(ids)) // config.canvas_length * config.canvas_length


def check_step_counts(steps, draft_steps, names=("steps", "draft_steps")) -> None:
    """The caller's denoising and draft steps (None: the plan's) within ``validate.MAX_STEPS``."""
    for value, name in zip((steps, draft_steps), names):
        if value is not None:
            check_steps(value, name)


def grammar_stop_ids(tokenizer, defaults: GenerationConfig) -> list[int]:
    """The ids that end a grammar's answer: the end of turn first (what the model writes after an
    answer), then the checkpoint's other stop ids."""
    end = end_of_turn(tokenizer, defaults)
    return ([end] if end is not None else []) + [i for i in defaults.eos_token_id if i != end]


def end_of_turn(tokenizer, defaults: GenerationConfig) -> int | None:
    """The id that ends a turn: ``<turn|>``, or the checkpoint's first stop id."""
    turn_end = tokenizer.token_id("<turn|>")
    return turn_end if turn_end is not None else (defaults.eos_token_id[0] if defaults.eos_token_id else None)


def check_template_fits(template: CanvasTemplate, prompt_length: int, config) -> None:
    """A ``TemplateError`` naming the culprit when the template's canvases run past the context."""
    canvas = config.canvas_length
    needed = -(-(len(template) + template.ends_turn) // canvas) * canvas
    context = config.max_position_embeddings
    if prompt_length + needed <= context:
        return
    room = context - prompt_length
    culprit = next((h for start, h in template.holes if start + h.size > room), None)
    where = f"the hole at {culprit.where} crosses it" if culprit else "its text alone is too long"
    raise TemplateError(
        f"the template takes {needed} canvas positions after the {prompt_length}-token prompt, "
        f"more than the {room} the model's context of {context} leaves ({where}); "
        f"make the holes smaller",
        context=True,
    )


def _prompt_and_images(
    model, tokenizer: Tokenizer, prompt: str | list[int], args: GenerationArgs
) -> tuple[list[int], dict]:
    """The prompt's ids with its images' placeholders expanded, and the images as ``model.encode`` takes them."""
    if isinstance(args.images, ImageInputs):  # preprocessed, the ids already expanded
        return (
            prompt_ids(tokenizer, prompt, args.system_prompt, args.chat_template, think=args.think),
            args.images.vision_inputs,
        )
    if args.videos:
        return _prompt_and_videos(model, tokenizer, prompt, args)
    ids = prompt_ids(tokenizer, prompt, args.system_prompt, args.chat_template, len(args.images or []), args.think)
    return image_inputs(model, ids, args.images) if args.images else (ids, {})


def _prompt_and_videos(model, tokenizer: Tokenizer, prompt: str | list[int], args: GenerationArgs):
    """``_prompt_and_images`` with videos: each clip's frames are images, laid out with their times in
    place of its placeholder (video.py), and must leave the context room for a canvas."""
    check_takes_images(model, "video")
    config = model.config
    processor = video_processor(model)
    videos = [args.videos] if isinstance(args.videos, (str, bytes, PathLike)) else args.videos
    clips = [load_video(video, processor, args.video_fps) for video in videos]
    video_token = tokenizer.token_id(VIDEO_PLACEHOLDER)
    if not isinstance(prompt, str) and video_token is None:
        raise PromptError(f"this tokenizer has no {VIDEO_PLACEHOLDER} token to place a video in ids; give text")
    images = []

    def place(given):
        placed, images[:] = place_videos(
            given,
            list(args.images or []),
            clips,
            processor,
            (config.image_token_id, video_token),
            lambda text: tokenizer.encode(text, add_special_tokens=False),
        )
        return placed

    count = len(args.images or [])
    ids = prompt_ids(tokenizer, prompt, args.system_prompt, args.chat_template, count, args.think, len(clips), place)
    ids, vision_inputs = image_inputs(model, ids, images)
    if len(ids) + config.canvas_length > config.max_position_embeddings:
        frames = sum(len(clip.frames) for clip in clips)
        raise PromptError(
            f"the prompt with its videos' {frames} frames is {len(ids)} tokens: with a {config.canvas_length}-token "
            f"canvas after it, past the model's context of {config.max_position_embeddings}; sample fewer frames "
            "(a lower video fps) or send a shorter clip",
            context=True,
        )
    return ids, vision_inputs


class _TemplateText:
    """The answer of a template, handed out whole once its last canvas is in."""

    def __init__(self, tokenizer: Tokenizer, template: CanvasTemplate, stop_ids, end_of_turn: int | None):
        self.tokenizer, self.template, self.stop_ids, self.end = tokenizer, template, stop_ids, end_of_turn
        self.tokens: list[int] = []

    def add(self, ids, final: bool = False) -> str:
        self.tokens.extend(int(i) for i in ids)
        if not final:
            return ""
        pad = self.tokenizer.pad_token_id
        if self.template.render is not None:
            values = self.template.hole_values(self.tokens, pad, self.end)
            return json.dumps(self.template.render([self.tokenizer.decode(v) for v in values]))
        return self.tokenizer.decode_clean(self.template.answer_tokens(self.tokens, pad, self.end), self.stop_ids)
