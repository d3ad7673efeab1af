"""A request made ready: ``prepare`` checks one and settles everything about it before any forward
(prompt ids, the context, the template, the plan, the draws, the text decoder), from one
``options.GenerationArgs``; ``generation_device`` is where generation runs. The engine (batch.py)
runs what it returns.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, replace

import mlx.core as mx

from ..errors import OptionError
from ..model.config import GenerationConfig
from ..model.images import ImageInputs, image_inputs
from ..options import GenerationArgs, check_prefill_step_size
from ..structured.closing import check_closing_fits, check_closing_room
from ..structured.grammar import Grammar, schema_grammar
from ..structured.template import CanvasTemplate, TemplateError, as_template, canvas_clamps
from ..tokenizer import TextStream, Tokenizer
from ..validate import PromptError, check_request, check_steps
from .drafting import DraftSettings
from .filters import filtering
from .policy import AutoPlanner, DraftRequest, Plan, auto_planner, cached_profile, make_plan
from .sampler import MxRandom, Random


@contextlib.contextmanager
def generation_device(model):
    """On Metal, as mlx-lm does: a stream of its own for generation and the model's memory wired
    for the duration (elsewhere nothing changes)."""
    if not mx.metal.is_available():
        yield
        return
    limit = mx.device_info()["max_recommended_working_set_size"]
    old = mx.set_wired_limit(limit)
    try:
        with mx.stream(mx.new_stream(mx.default_device())):
            yield
    finally:
        mx.synchronize()
        mx.set_wired_limit(old)


def generation_config(model, tokenizer: Tokenizer) -> GenerationConfig:
    """The checkpoint's generation_config.json (defaults for everything the caller leaves unset)."""
    return (getattr(model, "generation_config", None) or getattr(tokenizer, "generation_config", None)
            or GenerationConfig.from_dict({}, model.config))


def prompt_ids(tokenizer: Tokenizer, prompt: str | list[int], system_prompt: str | None = None,
               chat_template: bool = True, images: int = 0, think: bool = False) -> list[int]:
    """Token ids as given, or text through the chat template (or plain, with ``<bos>``); with
    ``images``, the user message starts with that many image placeholders; ``think`` is the
    template's thinking switch (``enable_thinking``)."""
    if not isinstance(prompt, str):
        return [int(i) for i in prompt]
    if not chat_template:
        return tokenizer.encode(prompt)
    if think and not tokenizer.renders_thinking:
        raise PromptError("this checkpoint's chat template has no thinking switch (enable_thinking); "
                          "drop think, or pass a prompt that opens the thought as token ids")
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
    content = [{"type": "image"}] * images + [{"type": "text", "text": prompt}] if images else prompt
    messages.append({"role": "user", "content": content})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, enable_thinking=think)


def check_prompt_fits(ids: list[int], config, max_tokens: int = 1, name: str = "max_tokens") -> None:
    """Ids in the vocabulary, and room in the context for them and every canvas ``max_tokens`` (the
    caller's ``name`` for it) takes."""
    if not ids:
        raise PromptError("the prompt is empty")
    if bad := [i for i in ids if not 0 <= i < config.vocab_size]:
        raise PromptError(f"prompt token id {bad[0]} is outside the vocabulary (0..{config.vocab_size - 1})")
    context, canvas = config.max_position_embeddings, config.canvas_length
    if len(ids) + canvas > context:
        raise PromptError(f"the prompt is {len(ids)} tokens: with a {canvas}-token canvas after it, "
                          f"it does not fit the model's context of {context} tokens")
    canvases = -(-max_tokens // canvas)
    if len(ids) + canvases * canvas > context:
        raise PromptError(f"{name} of {max_tokens} takes {canvases} canvases of {canvas} after the {len(ids)}-token "
                          f"prompt, past the model's context of {context} tokens; ask for at most "
                          f"{answer_room(ids, config)}")


def answer_room(ids: list[int], config) -> int:
    """The most tokens an answer may take after ``ids``: the whole canvases the context leaves."""
    return (config.max_position_embeddings - len(ids)) // config.canvas_length * config.canvas_length


def check_step_counts(steps, draft_steps, names=("steps", "draft_steps")) -> None:
    """The caller's denoising and draft steps (None: the plan's) within ``validate.MAX_STEPS``."""
    for value, name in zip((steps, draft_steps), names):
        if value is not None:
            check_steps(value, name)


def cut_at_stop(canvas: list[int], stop_ids) -> tuple[list[int], bool]:
    """The canvas up to and including its first stop id, and whether there was one."""
    for i, token in enumerate(canvas):
        if token in stop_ids:
            return canvas[: i + 1], True
    return canvas, False


@dataclass
class PreparedRequest:
    """One prompt made ready to generate: its ids, plan (with the sampler settings), draws and text decoder."""

    ids: list[int]
    max_tokens: int
    defaults: GenerationConfig
    plan: Plan
    overrides: dict  # the caller's sampler settings, applied to every plan (auto re-plans)
    rng: Random
    stop_ids: set[int]
    text: TextStream | _TemplateText
    template: CanvasTemplate | None
    end_of_turn: int | None
    vision_inputs: dict  # images as model.encode takes them (empty without images)
    planner: AutoPlanner | None = None  # the auto policy's, which re-plans at every canvas or round
    acceptance: object = None  # verified drafting's running estimate (policy.Acceptance)
    temperature: float = 0.0  # ar and verified sampling (0: greedy); diffusion's is in plan.settings
    grammar: Grammar | None = None  # a schema the canvas template does not take: ar and verified rows follow it
    thought: TextStream | None = None  # with think: the thought channel's text, handed out as it grows

    def canvas_clamps(self, tokenizer: Tokenizer, config):
        """The template's (length, Clamp) per canvas, or None without a template."""
        if self.template is None:
            return None
        return canvas_clamps(self.template, tokenizer, config.vocab_size, config.canvas_length, self.end_of_turn,
                             self.plan.last_canvas_length)


def prepare(model, tokenizer: Tokenizer, prompt: str | list[int], args: GenerationArgs) -> PreparedRequest:
    """Check a request and settle everything about it before any forward (see ``api.stream_generate``)."""
    config = model.config
    defaults = generation_config(model, tokenizer)
    max_tokens = defaults.max_new_tokens if args.max_tokens is None else args.max_tokens
    prompt = check_request(prompt, max_tokens, args.seed, args.system_prompt, args.chat_template)
    template, grammar = _layout(model, tokenizer, args, defaults)
    end_of_turn = _end_of_turn(tokenizer, defaults) if template is None or template.ends_turn else None
    if template is not None:
        max_tokens = len(template) + template.ends_turn
    overrides = args.sampling.overrides(defaults)  # they replace the plan's, and none is dropped
    check_step_counts(overrides.get("steps"), args.draft_steps)
    check_prefill_step_size(args.prefill_step_size, "prefill_step_size")
    if args.kv_quantization is not None:
        args.kv_quantization.check([config.layer_head_dim(i) for i in range(config.num_hidden_layers)])
    if args.think and (grammar is not None or template is not None and template.render is not None):
        raise ValueError("a JSON answer is laid out from its first token and leaves no room for a "
                         "thought; drop think or the schema")
    ids, vision_inputs = _prompt_and_images(model, tokenizer, prompt, args)
    check_prompt_fits(ids, config, max_tokens if template is None else 1)
    temperature = args.sampling.temperature or 0.0
    planner, acceptance, plan = _plan(model, defaults, args, template or grammar, max_tokens, overrides, ids)
    if plan.settings.penalizing and args.policy != "ar":
        name = _given(args, _PENALTIES) or "a penalty"
        raise OptionError(f"{name} applies to autoregressive decoding only (policy ar): a denoising step draws "
                          "tokens in no order, and verified drafting's exact sampling does not take it; take policy "
                          "ar or leave it out", name)
    if template is not None and plan.mode != "diffusion" and (
            temperature or filtering(*plan.settings.filters) or plan.settings.penalizing):
        raise OptionError(f"templates decode greedily under {plan.policy}; drop the temperature, the filters and "
                          "the penalties, or take a diffusion policy", _given(args, ("temperature", *_FILTERS, *_PENALTIES)))
    if grammar is not None:
        check_closing_room(grammar, config.vocab_size, answer_room(ids, config))
        check_closing_fits(grammar, config.vocab_size, max_tokens)
    if plan.mode == "verified":
        DraftSettings(plan.draft_length, plan.draft_steps, temperature).check(config.canvas_length)
    rng = MxRandom(args.seed) if args.rng is None else args.rng
    stop_ids = set(defaults.eos_token_id)
    if template is not None:
        check_template_fits(template, len(ids), config)
    text = answer_text(model, tokenizer, template)
    thought = TextStream(tokenizer, stop_ids, thought=True) if args.think else None
    return PreparedRequest(ids, max_tokens, defaults, plan, overrides, rng, stop_ids, text, template, end_of_turn,
                           vision_inputs, planner, acceptance, temperature, grammar, thought)


def _layout(model, tokenizer: Tokenizer, args: GenerationArgs, defaults: GenerationConfig
            ) -> tuple[CanvasTemplate | None, Grammar | None]:
    """The answer's canvas template, or its schema's grammar (``schema_template`` says which)."""
    limit = model.config.max_position_embeddings
    if args.schema is None:
        return as_template(tokenizer, args.template, limit=limit), None
    if args.template is not None:
        raise TemplateError("give a template or a schema, not both")
    if isinstance(args.schema, Grammar):  # compiled already (the server compiles it as it admits the request)
        return None, args.schema
    template = schema_template(tokenizer, args.schema, args.policy, limit, args.max_tokens)
    if template is not None:
        return template, None
    return None, schema_grammar(tokenizer, args.schema, model.config.vocab_size, grammar_stop_ids(tokenizer, defaults))


DIFFUSION_POLICIES = ("reference", "fast", "auto")  # those that lay a schema out as a canvas template where they can


def schema_template(tokenizer, schema, policy: str, limit: int, max_tokens: int | None = None
                    ) -> CanvasTemplate | None:
    """The canvas template of ``schema`` where a diffusion policy (reference, fast, auto) lays it out
    as one: the template expresses the schema (json_schema.py) and fits ``max_tokens``. None where the
    answer follows the schema's grammar instead: every other schema, and every schema under ar and
    verified (grammar.py)."""
    from ..structured.json_schema import json_template

    if policy not in DIFFUSION_POLICIES or not isinstance(schema, dict):
        return None
    try:
        template = json_template(tokenizer, schema, limit=limit)
    except TemplateError:
        return None
    return template if max_tokens is None or len(template) + 1 <= max_tokens else None


def grammar_stop_ids(tokenizer, defaults: GenerationConfig) -> list[int]:
    """The ids that end a grammar's answer: the end of turn first (what the model writes after an
    answer), then the checkpoint's other stop ids."""
    end = _end_of_turn(tokenizer, defaults)
    return ([end] if end is not None else []) + [i for i in defaults.eos_token_id if i != end]


_FILTERS = ("top_p", "top_k", "min_p")
_PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")


def _given(args: GenerationArgs, names: tuple[str, ...]) -> str | None:
    """The first of the sampling options ``names`` that ``args`` sets."""
    return next((name for name in names if getattr(args.sampling, name) is not None), None)


def _prompt_and_images(model, tokenizer: Tokenizer, prompt: str | list[int], args: GenerationArgs
                       ) -> tuple[list[int], dict]:
    """The prompt's ids with its images' placeholders expanded, and the images as ``model.encode`` takes them."""
    if isinstance(args.images, ImageInputs):  # preprocessed, the ids already expanded
        return (prompt_ids(tokenizer, prompt, args.system_prompt, args.chat_template, think=args.think),
                args.images.vision_inputs)
    ids = prompt_ids(tokenizer, prompt, args.system_prompt, args.chat_template, len(args.images or []), args.think)
    return image_inputs(model, ids, args.images) if args.images else (ids, {})


def _plan(model, defaults: GenerationConfig, args: GenerationArgs, layout, max_tokens: int, overrides: dict,
          ids: list[int]) -> tuple[AutoPlanner | None, object, Plan]:
    """The request's auto planner (auto without a template or grammar: it re-plans at every canvas,
    block or round), verified drafting's running acceptance estimate, and its first plan. Under a
    grammar a diffusion policy drafts and verifies (verified drafting): the grammar decides each
    token as the encoder verifies it."""
    policy, profile = args.policy, args.profile
    if isinstance(layout, Grammar) and policy != "ar":
        policy = "verified"
    if profile is None and (policy == "auto" or policy == "verified" and None in (args.draft_length, args.draft_steps)):
        profile = cached_profile(model)
    if policy == "auto" and layout is None:
        planner = (AutoPlanner(defaults, model.config.canvas_length, profile, args.expected_steps)
                   if args.expected_steps else auto_planner(model, defaults, profile))
        return planner, None, planner.choose(max_tokens, overrides, prompt=ids)  # from answers to prompts like it
    acceptance = auto_planner(model, defaults, profile).acceptance if policy == "verified" and profile else None
    plan = make_plan(policy, defaults, model.config.canvas_length, max_tokens, profile, args.expected_steps,
                     DraftRequest(args.draft_length, args.draft_steps, acceptance))
    if policy != args.policy:
        plan = replace(plan, policy=args.policy, reasons=[f"{args.policy} with a schema the canvas template does not "
                                                          "take: verified drafting under its grammar"] + plan.reasons)
    return None, acceptance, plan.overridden(overrides)


def answer_text(model, tokenizer: Tokenizer, template: CanvasTemplate | None = None):
    """What an answer's committed tokens read as, handed out piece by piece (``.add(ids, final)``):
    the clean text, or a template's answer (whole with the last piece)."""
    defaults = generation_config(model, tokenizer)
    stop_ids = set(defaults.eos_token_id)
    if template is None:
        return TextStream(tokenizer, stop_ids)
    end_of_turn = _end_of_turn(tokenizer, defaults) if template.ends_turn else None
    return _TemplateText(tokenizer, template, stop_ids, end_of_turn)


def _end_of_turn(tokenizer, defaults: GenerationConfig) -> int | None:
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
    raise TemplateError(f"the template takes {needed} canvas positions after the {prompt_length}-token prompt, "
                        f"more than the {room} the model's context of {context} leaves ({where}); "
                        f"make the holes smaller")


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
