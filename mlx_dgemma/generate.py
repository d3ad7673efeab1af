"""Block-autoregressive generation: encode the prompt, denoise a canvas, commit it, encode it, and on to
the next canvas, as the reference ``generate()`` does. Python API shaped like mlx-lm's
(``generate``, ``stream_generate``) and the CLI::

    python -m mlx_dgemma.generate --prompt "sort: 42 17 85 23 61" --view
"""

from __future__ import annotations

from . import fast_blas

fast_blas.load()  # a command-line process: the fast BLAS before mlx.core loads

import contextlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from dataclasses import dataclass, fields  # noqa: E402
from pathlib import Path  # noqa: E402

import click  # noqa: E402
import mlx.core as mx  # noqa: E402

from . import drafting
from .cli import command_line
from .config import GenerationConfig
from .images import image_inputs, load_image
from .policy import POLICIES, AutoPlanner, Plan, Profile, auto_planner, cached_profile, make_plan
from .sampler import Draft, MxRandom, Random, SamplerSettings, denoise_canvas
from .template import CanvasTemplate, TemplateError, as_template, canvas_clamps, parse_template
from .tokenizer import TextStream, Tokenizer
from .validate import (
    PromptError,
    at_least,
    check_entropy_bound,
    check_request,
    check_seed,
    check_steps,
    check_temperature,
    check_text,
    decode_utf8,
    option,
)

DEMO_MODEL = Path(__file__).resolve().parent / "demo"
DEFAULT_PROMPT = "sort: 42 17 85 23 61"
PREFILL_STEP_SIZE = 2048  # mlx-lm's default: prompt tokens encoded per forward


def prefill(model, ids: mx.array, cache, step_size: int = PREFILL_STEP_SIZE, logits: bool = False,
            **vision_inputs) -> mx.array | None:
    """Encode prompt rows ``ids`` [B, T] into ``cache`` ``step_size`` tokens at a time, evaluating
    after each chunk so that peak memory is one chunk's activations, not the whole prompt's. With
    ``logits``, the next-token logits [B, V] after the prompt (autoregressive decoding starts there).
    A prompt with images goes in one forward (an image block attends to itself both ways)."""
    ids = mx.array(ids, dtype=mx.int32)
    ids = ids.reshape(1, -1) if ids.ndim == 1 else ids
    T = ids.shape[1]
    if vision_inputs:
        step_size = T
    for start in range(0, T, step_size):
        chunk = ids[:, start : start + step_size]
        if logits and start + step_size >= T:
            out = model.next_token_logits(chunk, cache, **vision_inputs)
            mx.eval(out, cache.state())
            return out
        model.encode(chunk, cache, **vision_inputs)
        mx.eval(cache.state())
    return None


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


@dataclass
class GenerationResponse:
    """One committed canvas."""

    text: str  # the text this canvas adds to the answer
    tokens: list[int]  # the canvas's committed ids, up to and including a stop id, within max_tokens
    steps: int  # denoising steps this canvas took
    tokens_per_forward: float  # non-pad tokens committed so far per denoising forward (whole canvases)
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int  # committed so far
    generation_tps: float
    peak_memory: float  # GB
    finish_reason: str | None  # "stop" (a stop id), "length" (max tokens), None while more follow
    drafts: list[Draft] | None = None  # per-step argmax drafts, when asked for
    plan: Plan | None = None  # how this generation was run (policy's choice and reasons)


@dataclass
class Block:
    """What a decoding mode hands on at a time: a committed canvas, a block of AR tokens or a
    verified round."""

    tokens: list[int]
    stopped: bool  # it ends with a stop id (or a template's end)
    forwards: int  # the model forwards it took (denoising steps, tokens, draft steps + the verifying pass)
    drafts: list[Draft] | None = None  # per-step argmax canvases, when asked for
    last: bool = False  # nothing follows


def generation_config(model, tokenizer: Tokenizer) -> GenerationConfig:
    """The checkpoint's generation_config.json (defaults for everything the caller leaves unset)."""
    return (getattr(model, "generation_config", None) or getattr(tokenizer, "generation_config", None)
            or GenerationConfig.from_dict({}, model.config))


def prompt_ids(tokenizer: Tokenizer, prompt: str | list[int], system_prompt: str | None = None,
               chat_template: bool = True, images: int = 0) -> list[int]:
    """Token ids as given, or text through the chat template (or plain, with ``<bos>``); with
    ``images``, the user message starts with that many image placeholders."""
    if not isinstance(prompt, str):
        return [int(i) for i in prompt]
    if not chat_template:
        return tokenizer.encode(prompt)
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
    content = [{"type": "image"}] * images + [{"type": "text", "text": prompt}] if images else prompt
    messages.append({"role": "user", "content": content})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)


def check_prompt(ids: list[int], config, max_tokens: int = 1) -> None:
    """Ids in the vocabulary, and room in the context for them and every canvas ``max_tokens`` takes."""
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
        room = (context - len(ids)) // canvas * canvas
        raise PromptError(f"{max_tokens} max tokens take {canvases} canvases of {canvas} after the {len(ids)}-token "
                          f"prompt, past the model's context of {context} tokens; ask for at most {room}")


def check_step_counts(defaults: GenerationConfig, steps, draft_steps, names=("steps", "draft_steps")) -> None:
    """The caller's denoising and draft steps (None: the plan's) within the checkpoint's ``max_denoising_steps``."""
    for value, name in zip((steps, draft_steps), names):
        if value is not None:
            check_steps(value, defaults.max_denoising_steps, name)


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
    temperature: float = 0.0  # ar and verified sampling (0: greedy)

    def canvas_clamps(self, tokenizer: Tokenizer, config):
        """The template's (length, Clamp) per canvas, or None without a template."""
        if self.template is None:
            return None
        return canvas_clamps(self.template, tokenizer, config.vocab_size, config.canvas_length, self.end_of_turn,
                             self.plan.last_canvas_length)


def prepare(model, tokenizer: Tokenizer, prompt: str | list[int], max_tokens: int | None = None, *,
            steps: int | None = None, seed: int | None = None, rng: Random | None = None,
            entropy_bound: float | None = None, temp_min: float | None = None, temp_max: float | None = None,
            freeze_after: int | None = None, settings: SamplerSettings | None = None,
            system_prompt: str | None = None, chat_template: bool = True, policy: str = "reference",
            profile: Profile | None = None, expected_steps: float | None = None,
            template: str | CanvasTemplate | None = None, images: list | None = None,
            temperature: float | None = None, draft_length: int | None = None, draft_steps: int | None = None
            ) -> PreparedRequest:
    """Check a request and settle everything about it before any forward (see ``stream_generate``)."""
    config = model.config
    defaults = generation_config(model, tokenizer)
    max_tokens = defaults.max_new_tokens if max_tokens is None else max_tokens
    prompt = check_request(prompt, max_tokens, seed, system_prompt, chat_template)
    template = as_template(tokenizer, template, limit=config.max_position_embeddings)
    end_of_turn = _end_of_turn(tokenizer, defaults) if template is None or template.ends_turn else None
    if template is not None:
        max_tokens = len(template) + template.ends_turn
    if profile is None and (policy == "auto" or policy == "verified" and None in (draft_length, draft_steps)):
        profile = cached_profile(model)
    planner = acceptance = None
    # The caller's sampler settings: ``settings`` as a whole, then every explicit number on top; they
    # replace the plan's, and none is dropped.
    overrides = {f.name: getattr(settings, f.name) for f in fields(settings)} if settings else {}
    given = dict(steps=steps, entropy_bound=entropy_bound, t_min=temp_min, t_max=temp_max, freeze_after=freeze_after)
    overrides.update({k: v for k, v in given.items() if v is not None})
    check_step_counts(defaults, overrides.get("steps"), draft_steps)
    ids = prompt_ids(tokenizer, prompt, system_prompt, chat_template, len(images or []))
    ids, vision_inputs = image_inputs(model, ids, images) if images else (ids, {})
    check_prompt(ids, config, max_tokens if template is None else 1)
    if policy == "auto" and template is None:  # re-planned at every canvas or round
        planner = (AutoPlanner(defaults, config.canvas_length, profile, expected_steps) if expected_steps
                   else auto_planner(model, defaults, profile))
        planner.sampling = bool(temperature)  # a temperature is for ar and verified only
        plan = planner.choose(max_tokens, overrides, prompt=ids)  # from what answers to prompts like it did
    else:
        acceptance = auto_planner(model, defaults, profile).acceptance if policy == "verified" and profile else None
        plan = make_plan(policy, defaults, config.canvas_length, max_tokens, profile, expected_steps,
                         draft_length=draft_length, draft_steps=draft_steps, acceptance=acceptance).overridden(overrides)
    if temperature and plan.mode == "diffusion":
        raise ValueError("a temperature applies to autoregressive and verified decoding; "
                         "diffusion takes --temp-min/--temp-max")
    if temperature and template is not None:
        raise ValueError("templates decode greedily; drop the temperature")
    rng = MxRandom(seed) if rng is None else rng
    stop_ids = set(defaults.eos_token_id)
    if template is not None:
        check_template_fits(template, len(ids), config)
    text = answer_text(model, tokenizer, template)

    return PreparedRequest(ids, max_tokens, defaults, plan, overrides, rng, stop_ids, text, template, end_of_turn, vision_inputs,
               planner, acceptance, temperature or 0.0)


def stream_generate(
    model,
    tokenizer: Tokenizer,
    prompt: str | list[int],
    max_tokens: int | None = None,
    *,
    steps: int | None = None,
    seed: int | None = None,
    rng: Random | None = None,
    entropy_bound: float | None = None,
    temp_min: float | None = None,
    temp_max: float | None = None,
    freeze_after: int | None = None,
    settings: SamplerSettings | None = None,
    system_prompt: str | None = None,
    chat_template: bool = True,
    drafts: bool = False,
    on_step: Callable[[Draft], None] | None = None,
    policy: str = "reference",
    profile: Profile | None = None,
    expected_steps: float | None = None,
    template: str | CanvasTemplate | None = None,
    temperature: float | None = None,
    draft_length: int | None = None,
    draft_steps: int | None = None,
    prefill_step_size: int = PREFILL_STEP_SIZE,
    images: list | None = None,
    prompt_cache=None,
) -> Iterator[GenerationResponse]:
    """Yield one ``GenerationResponse`` per committed canvas.

    ``prompt`` is text (the chat template is applied unless ``chat_template=False``) or token ids.
    Unset numbers come from the checkpoint's generation config; ``max_tokens`` is computed in whole
    canvases, as the reference does, and the text and tokens handed out stop at it. ``rng`` replaces
    the seeded ``mx.random`` draws; ``settings`` replaces the sampler settings built from the rest.
    ``drafts=True`` attaches each step's argmax canvas to the responses; ``on_step`` is called with it
    as soon as the step is done.

    ``policy`` picks how to generate (policy.py): "reference" (the generation config, exactly),
    "auto" (whichever of the others this device's ``profile`` — measured once and cached when not
    given — and what the model did so far predict fastest, re-chosen at every canvas or round;
    ``expected_steps`` per canvas replaces its prior and its memory of earlier generations), "fast" (active-set
    compaction, no confirming step, a trimmed last canvas), "ar" or "verified" (drafting.py: the
    decoder drafts ``draft_length`` tokens in ``draft_steps`` steps, the encoder verifies them; one
    response per round). Explicit sampler numbers override the plan; ``freeze_after`` is the
    compaction's (sampler.SamplerSettings). ``temperature`` (ar and verified; default 0, greedy)
    samples the answer at that temperature; verified output has the ar distribution exactly.

    ``template`` lays the answer out in advance (template.py): text with ``{{fill:N}}`` holes, or a
    ``CanvasTemplate`` (``json_template(tokenizer, schema)``, ``infill_template``). Its literal
    tokens are clamped, the answer ends with it, and ``max_tokens`` is ignored; the text arrives
    whole with the last response (a hole's value is known only when its canvas commits).

    ``images`` (paths or PIL images; a checkpoint with a vision tower) go with the prompt: a text
    prompt gets one image placeholder per image before the text; ids or an untemplated prompt must
    hold them (the image token, ``<|image|>``) themselves.

    ``prompt_cache`` (``model.make_cache()``) may already hold the prompt's first ``offset`` ids, images
    placed (a server's prompt cache): only the rest is encoded, and the answer is appended to it.
    """
    if prompt_cache is not None and images:
        raise ValueError("give the images or a prompt cache that already holds them, not both")
    job = prepare(model, tokenizer, prompt, max_tokens, steps=steps, seed=seed, rng=rng, entropy_bound=entropy_bound,
                  temp_min=temp_min, temp_max=temp_max, freeze_after=freeze_after, settings=settings,
                  system_prompt=system_prompt, chat_template=chat_template, policy=policy, profile=profile,
                  expected_steps=expected_steps, template=template, images=images, temperature=temperature,
                  draft_length=draft_length, draft_steps=draft_steps)
    config, defaults, plan, ids, template = model.config, job.defaults, job.plan, job.ids, job.template
    max_tokens, rng, stop_ids, text, end_of_turn = job.max_tokens, job.rng, job.stop_ids, job.text, job.end_of_turn

    with generation_device(model):
        cache = model.make_cache() if prompt_cache is None else prompt_cache
        if cache.offset >= len(ids):
            raise ValueError(f"the prompt cache holds {cache.offset} ids of a {len(ids)}-id prompt; "
                             "at least its last id must be left to encode")
        tic, cached = time.perf_counter(), cache.offset
        planner, temperature = job.planner, job.temperature
        first_logits = prefill(model, mx.array(ids[cached:]), cache, prefill_step_size,
                               logits=plan.mode in ("ar", "verified") or planner is not None, **job.vision_inputs)
        prompt_tps = (len(ids) - cached) / (time.perf_counter() - tic)

        tic = time.perf_counter()
        if planner is not None:
            blocks = adaptive(model, cache, first_logits, planner, plan, job.overrides, max_tokens, job.ids, rng, stop_ids,
                              temperature)
        elif plan.mode == "ar" and template is not None:
            blocks = autoregressive_template(model, cache, first_logits, template, tokenizer, end_of_turn,
                                             config.canvas_length)
        elif plan.mode == "ar":
            blocks = autoregressive(model, cache, first_logits, max_tokens, config.canvas_length, stop_ids,
                                    temperature, rng)
        elif plan.mode == "verified":
            rule = (drafting.TemplateRule(template, tokenizer, config.vocab_size, end_of_turn) if template is not None
                    else drafting.SampledRule(stop_ids, max_tokens, temperature, rng) if temperature
                    else drafting.GreedyRule(stop_ids, max_tokens))
            blocks = verified(model, cache, first_logits, rule,
                              drafting.DraftSettings(plan.draft_length, plan.draft_steps, temperature),
                              plan.settings, rng, stop_ids, job.acceptance)
        else:
            clamps = job.canvas_clamps(tokenizer, config)
            blocks = diffusion(model, cache, max_tokens, plan, rng, stop_ids, drafts, on_step, clamps)
        total_steps = generated = non_pad = 0
        for block in blocks:
            tokens, stopped, forwards, step_drafts, last = (block.tokens, block.stopped, block.forwards, block.drafts,
                                                            block.last)
            total_steps += forwards
            non_pad += sum(t != defaults.pad_token_id for t in tokens)  # the reference's statistic
            room = max_tokens - generated
            if template is None and len(tokens) >= room:  # a canvas may compute more than was asked for
                stopped, last = stopped and len(tokens) <= room, True
                tokens = tokens[:room]
            generated += len(tokens)
            finish = "stop" if stopped else "length" if last else None
            yield GenerationResponse(
                text=text.add(tokens, final=finish is not None),
                tokens=tokens,
                steps=forwards,
                tokens_per_forward=non_pad / total_steps,
                prompt_tokens=len(ids),
                prompt_tps=prompt_tps,
                generation_tokens=generated,
                generation_tps=generated / (time.perf_counter() - tic),
                peak_memory=mx.get_peak_memory() / 1e9,
                finish_reason=finish,
                drafts=step_drafts,
                plan=planner.current if planner is not None else plan,
            )
            if finish:
                return


def diffusion(model, cache, max_tokens: int, plan: Plan, rng: Random, stop_ids, drafts: bool, on_step,
              clamps=None) -> Iterator[Block]:
    """Canvas after canvas: (committed tokens up to a stop id, stopped, steps, drafts, is last).
    ``clamps`` (a template's (length, Clamp) per canvas) fixes the canvases and their number."""
    full = model.config.canvas_length
    remaining = max_tokens
    for index in range(len(clamps) if clamps else 1 << 62):
        length, clamp = clamps[index] if clamps else (plan.last_canvas_length(remaining, full), None)
        step_drafts: list[Draft] | None = [] if drafts else None
        result = denoise_canvas(model, cache, plan.settings, rng, _step_hook(step_drafts, on_step), length, clamp)
        tokens, stopped = cut_at_stop(result.tokens[0].tolist(), stop_ids)
        if clamps:  # a template's canvases stay whole and aligned with it; it ends with its last one
            tokens, stopped = result.tokens[0].tolist(), index == len(clamps) - 1
        remaining -= length
        last = stopped or remaining <= 0
        yield Block(tokens, stopped, result.steps, step_drafts, last)
        if last:
            return
        model.encode(result.tokens, cache)  # the commit joins the prefix only when another canvas follows


def autoregressive(model, cache, logits: mx.array, max_tokens: int, block: int, stop_ids, temperature: float = 0.0,
                   rng: Random | None = None) -> Iterator[Block]:
    """Decoding with the encoder as a causal LM from the prompt's next-token ``logits``, greedy or
    (``temperature`` > 0) sampled through ``rng``, yielded in blocks of ``block`` tokens (one forward
    per token). The next token's forward is queued before the current one is read, so the host never
    waits on an idle device."""

    def pick(logits: mx.array) -> mx.array:
        if temperature:
            return rng.categorical(drafting.tempered_probs(logits, temperature))[:, None]
        return logits.argmax(-1, keepdims=True)

    chunk: list[int] = []
    token = pick(logits)
    for produced in range(1, max_tokens + 1):
        following = None
        if produced < max_tokens:
            following = pick(model.next_token_logits(token, cache))
            mx.async_eval(following)
        chunk.append(token.item())
        stopped = chunk[-1] in stop_ids
        last = stopped or produced == max_tokens
        if last or len(chunk) == block:
            yield Block(chunk, stopped, len(chunk), None, last)
            if last:
                return
            chunk = []
        token = following


def autoregressive_template(model, cache, logits: mx.array, template: CanvasTemplate, tokenizer,
                            end_of_turn: int | None, block: int) -> Iterator[Block]:
    """A template in autoregressive mode (drafting.TemplateRule: literal tokens forced, holes decoded
    greedily in their token class), one forward per token fed. Yields the template-aligned tokens in
    blocks of ``block``."""
    rule = drafting.TemplateRule(template, tokenizer, model.config.vocab_size, end_of_turn)
    forwards = [0]  # forwards made by the time each output position was written
    while True:
        token = rule.step(logits)
        forwards += [forwards[-1]] * (len(rule.output) + 1 - len(forwards))
        if token is None or rule.done:
            break
        logits = model.next_token_logits(mx.array([[token]]), cache)
        forwards[-1] += 1
    out = rule.output
    for k in range(0, len(out), block):
        chunk = out[k:k + block]
        last = k + block >= len(out)
        yield Block(chunk, last, max(1, forwards[min(k + block, len(out))] - forwards[k]), None, last)


def verified(model, cache, logits: mx.array, rule, draft: drafting.DraftSettings, schedule: SamplerSettings,
             rng: Random, stop_ids, acceptance=None) -> Iterator[Block]:
    """Verified drafting (drafting.py) from the prompt's next-token ``logits``: one block per round,
    with the round's forwards (draft steps + the verifying encoder pass); each round updates the
    running ``acceptance`` estimate (policy.Acceptance) the next generation's plan starts from."""
    template = isinstance(rule, drafting.TemplateRule)
    for tokens, done, forwards, kept, length in drafting.verified(model, cache, logits, rule, draft, schedule, rng):
        if acceptance is not None and length > 1:
            acceptance.observe(draft.steps, length, kept, not done and kept < length - 1)
        stopped = done and (template or bool(tokens) and tokens[-1] in stop_ids)
        yield Block(tokens, stopped, max(forwards, 1), None, done)


AR_BLOCK_MIN = 4  # tokens auto decodes autoregressively before it chooses again


def adaptive(model, cache, logits: mx.array, planner: AutoPlanner, plan: Plan, overrides: dict, max_tokens: int,
             prompt: list[int], rng: Random, stop_ids, temperature: float = 0.0) -> Iterator[Block]:
    """The auto policy: before each canvas, AR block (as many tokens as the answer is expected still to
    have) or verified round the planner picks a plan from its current estimates (``plan``: its first
    choice), with the caller's sampler ``overrides``, and learns from what the step did. Everything
    emitted is in the cache at a switch: a committed canvas is encoded, as is verified drafting's
    decided next token; ``logits`` are the next-token logits after the cache."""
    canvas = model.config.canvas_length
    remaining, known, rule, produced = max_tokens, None, None, 0
    while True:
        plan = plan or planner.choose(remaining, overrides, produced, prompt)
        if plan.mode != "verified" and known is not None:  # leaving verified drafting
            logits, known = model.next_token_logits(mx.array([[known]]), cache), None
        tic = time.perf_counter()
        if plan.mode == "diffusion":
            length = plan.last_canvas_length(remaining, canvas)
            result = denoise_canvas(model, cache, plan.settings, rng, None, length)
            tokens, stopped = cut_at_stop(result.tokens[0].tolist(), stop_ids)
            name, seconds = "fast" if plan.settings.freeze_after else "reference", time.perf_counter() - tic
            remaining -= length
            produced += len(tokens)
            last = stopped or remaining <= 0
            if last:  # said before the last block: its consumer stops at it
                planner.observe_canvas(name, result.steps, length, seconds, len(tokens), prompt)
                planner.observe_answer(min(produced, max_tokens), prompt)
            yield Block(tokens, stopped, result.steps, None, last)
            if last:
                return
            tic = time.perf_counter()  # the commit's encode is part of the canvas's cost
            logits = model.head(model.encode(result.tokens, cache, return_hidden=True)[:, -1])
            mx.eval(logits)
            planner.observe_canvas(name, result.steps, length, seconds + time.perf_counter() - tic, len(tokens), prompt)
        elif plan.mode == "ar":
            tokens, stopped = [], False
            # A block as long as the answer is expected still to be (a canvas at most, AR_BLOCK_MIN at
            # least): when AR was chosen for a short answer and it runs on, the planner chooses again soon.
            size = min(canvas, remaining, max(AR_BLOCK_MIN, math.ceil(planner.expected_tokens(produced, prompt))))
            for block in autoregressive(model, cache, logits, size, size, stop_ids, temperature, rng):
                tokens, stopped = block.tokens, block.stopped
            planner.observe_ar(len(tokens), time.perf_counter() - tic, prompt)
            remaining -= len(tokens)
            produced += len(tokens)
            last = stopped or remaining <= 0
            if last:  # said before the last block: its consumer stops at it
                planner.observe_answer(min(produced, max_tokens), prompt)
            yield Block(tokens, stopped, len(tokens), None, last)
            if last:
                return
            logits = model.next_token_logits(mx.array([tokens[-1:]]), cache)
        else:
            emitted, forwards = [], 0
            if known is None:  # entering verified drafting: decide the next token
                rule = (drafting.SampledRule(stop_ids, remaining, temperature, rng) if temperature
                        else drafting.GreedyRule(stop_ids, remaining))
                _, known = rule.follow(logits, [])
                emitted = rule.output[:]
            if known is not None:
                settings = drafting.DraftSettings(plan.draft_length, plan.draft_steps, temperature)
                step = drafting.verify_round(model, cache, known, rule, settings, plan.settings, rng)
                known, forwards = step.known, step.forwards
                planner.observe_round(step.length, plan.draft_steps, step.kept,
                                      known is not None and step.kept < step.length - 1, len(step.tokens),
                                      time.perf_counter() - tic, final=known is None, prompt=prompt)
                emitted += step.tokens
            remaining -= len(emitted)
            produced += len(emitted)
            last = known is None
            if last:  # said before the last block: its consumer stops at it
                planner.observe_answer(min(produced, max_tokens), prompt)
            yield Block(emitted, last and emitted[-1] in stop_ids, max(forwards, 1), None, last)
            if last:
                return
        plan = None


def infill(model, tokenizer: Tokenizer, prefix: str | list[int], suffix: str, max_fill: int = 64, **kwargs) -> str:
    """The text between ``prefix`` and ``suffix``. The prefix (text as it is, no chat template, or
    ids) goes to the encoder cache; the suffix is clamped at the end of the canvas, after a hole of at
    least ``max_fill`` tokens that may take several canvases. ``kwargs`` are those of ``stream_generate``."""
    from .template import infill_template

    template = infill_template(tokenizer, suffix, max_fill, model.config.canvas_length)
    kwargs.setdefault("chat_template", False)
    if isinstance(prefix, str) and not kwargs["chat_template"]:  # an empty or blank prefix is a fine start
        prefix = tokenizer.encode(check_text(prefix, "the prefix"))
    responses = list(stream_generate(model, tokenizer, prefix, template=template, **kwargs))
    answer = responses[-1].text
    tail = tokenizer.decode(template.tokens[template.holes[0][1].size:])
    return answer[: len(answer) - len(tail)] if tail and answer.endswith(tail) else answer


def drafted_json_template(model, tokenizer: Tokenizer, prompt: str | list[int], schema: dict, **kwargs
                          ) -> CanvasTemplate:
    """The JSON template of ``schema`` with its holes sized by a free generation's values (one more
    generation; ``kwargs`` are those of ``stream_generate``). On the demo tasks: right 98% of the
    time against 54% with upper-bound holes and 94% free, always valid."""
    from .template import json_template

    limit = model.config.max_position_embeddings
    json_template(tokenizer, schema, limit=limit)  # a bad schema fails before any generation
    free = generate(model, tokenizer, prompt, **kwargs)
    try:
        draft = json.loads(free)
    except ValueError:
        draft = None
    return json_template(tokenizer, schema, draft=draft, limit=limit)


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


def _step_hook(collected: list[Draft] | None, on_step: Callable[[Draft], None] | None):
    if collected is None:
        return on_step

    def hook(draft: Draft) -> None:
        collected.append(draft)
        if on_step is not None:
            on_step(draft)

    return hook


def generate(model, tokenizer: Tokenizer, prompt: str | list[int], max_tokens: int | None = None, *,
             verbose: bool = False, **kwargs) -> str:
    """The whole answer as text; ``kwargs`` are those of ``stream_generate``. ``verbose`` prints the
    text as canvases commit, then the statistics."""
    text, responses = "", []
    for response in stream_generate(model, tokenizer, prompt, max_tokens, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
        responses.append(response)
    if verbose:
        print("\n" + statistics(responses))
    return text


def statistics(responses: list[GenerationResponse]) -> str:
    last = responses[-1]
    verified = all(r.plan is not None and r.plan.mode == "verified" for r in responses)
    unit, forwards = ("rounds", "Forwards per round (draft steps + the verifying pass)") if verified else (
        "canvases", "Denoising steps per canvas")
    extra = f", {last.generation_tokens / len(responses):.2f} tokens per round" if verified else ""
    return "\n".join([
        "=" * 10,
        f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec",
        f"Generation: {last.generation_tokens} tokens in {len(responses)} {unit}, "
        f"{last.generation_tps:.3f} tokens-per-sec",
        f"{forwards}: {' '.join(str(r.steps) for r in responses)}; "
        f"{last.tokens_per_forward:.2f} tokens per forward{extra}",
        f"Finish: {last.finish_reason}",
        f"Peak memory: {last.peak_memory:.3f} GB",
    ])



@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", help=f"Checkpoint folder or Hugging Face Hub id [default: the bundled demo, {DEMO_MODEL}]")
@click.option("--prompt", "-p", default=DEFAULT_PROMPT, show_default=True,
              help="Message to the model; '-' reads stdin.")
@click.option("--system-prompt", help="System message for the chat template.")
@click.option("--max-tokens", "-m", type=int, callback=option(at_least(1)),
              help="Most tokens to print (computed in whole canvases) [default: the checkpoint's max_new_tokens].")
@click.option("--steps", type=int, callback=option(at_least(1)), help="Most denoising steps per canvas.")
@click.option("--entropy-bound", type=float, callback=option(check_entropy_bound),
              help="Entropy bound of the sampler's acceptance (nats).")
@click.option("--temp-min", type=float, callback=option(check_temperature),
              help="Temperature at the last denoising step.")
@click.option("--temp-max", type=float, callback=option(check_temperature),
              help="Temperature at the first denoising step.")
@click.option("--seed", type=int, callback=option(check_seed),
              help="Seed of the sampler's random draws (0 to 2**64 - 1).")
@click.option("--ignore-chat-template", is_flag=True, help="Give the prompt to the model as it is.")
@click.option("--verbose", is_flag=True, help="Print statistics after the text.")
@click.option("--view", is_flag=True, help="Show each canvas settling, step by step.")
@click.option("--policy", type=click.Choice(POLICIES), default="reference", show_default=True,
              help="reference: the generation config; auto: the policy this device runs fastest (measured once, "
                   "cached; re-chosen as it generates); fast: settled positions no longer computed, trimmed last "
                   "canvas; ar: autoregressive; verified: the decoder drafts, the encoder verifies (AR's output).")
@click.option("--draft-length", type=int, callback=option(at_least(1)),
              help="verified: canvas positions per draft, the known next token included [default: the policy's].")
@click.option("--draft-steps", type=int, callback=option(at_least(1)),
              help="verified: denoising steps per draft [default: the policy's].")
@click.option("--temp", type=float, callback=option(check_temperature),
              help="ar and verified: sampling temperature [default: 0, greedy].")
@click.option("--template", "template_file", type=click.Path(dir_okay=False),
              help="File with the answer's layout: fixed text and {{fill:N}} holes the model fills "
                   "(the file's final newline is not part of it).")
@click.option("--prefill-step-size", type=int, default=PREFILL_STEP_SIZE, show_default=True, callback=option(at_least(1)),
              help="Prompt tokens encoded per forward (bounds the prefill's peak memory).")
@click.option("--schema", "schema_file", type=click.Path(dir_okay=False),
              help="JSON schema file: the answer is JSON of this schema (structure fixed, values filled in "
                   "holes sized by a free draft generated first).")
@click.option("--adapter-path", help="Adapters of a fine-tuning run (python -m mlx_dgemma.lora) to apply.")
@click.option("--image", "image_files", multiple=True, metavar="PATH",
              help="Image to go with the prompt (repeatable; a checkpoint with a vision tower).")
@command_line
def main(model, prompt, system_prompt, max_tokens, steps, entropy_bound, temp_min, temp_max, seed,
         ignore_chat_template, verbose, view, policy, draft_length, draft_steps, temp, template_file, prefill_step_size,
         schema_file, image_files, adapter_path):
    """Generate text with a DiffusionGemma model; text appears as each canvas is committed."""
    if model is None and not DEMO_MODEL.is_dir():
        raise click.ClickException(f"the bundled demo model is not in {DEMO_MODEL}; pass --model PATH")
    if template_file and schema_file:
        raise click.ClickException("give --template or --schema, not both")
    if system_prompt is not None and ignore_chat_template:
        raise click.ClickException("--system-prompt needs the chat template: drop --ignore-chat-template "
                                   "or put the system text in --prompt")
    from . import distributed

    group = watchdog = None
    if distributed.launched():  # under mlx.launch: one model over every rank; rank 0 prints
        try:
            group = distributed.init()
        except distributed.DistributedError as e:
            raise click.ClickException(str(e)) from None
        if group.size() > 1:
            watchdog = distributed.Watchdog(group.rank(), distributed.timeout_seconds())
            if group.rank() != 0:
                sys.stdout, view, verbose = open(os.devnull, "w"), False, False
        else:
            group = None
    try:
        with watchdog.watching() if watchdog else contextlib.nullcontext():
            responses, canvas_view = _generate_cli(
                model, prompt, system_prompt, max_tokens, steps, entropy_bound, temp_min, temp_max, seed,
                ignore_chat_template, verbose, view, policy, draft_length, draft_steps, temp, template_file,
                prefill_step_size, schema_file, image_files, group, watchdog, adapter_path)
    except ValueError as e:  # bad input: checkpoint, prompt or settings; the message says which
        raise click.ClickException(str(e)) from None
    except distributed.DistributedError as e:
        raise click.ClickException(str(e)) from None
    except RuntimeError as e:  # a collective whose peer is gone
        if group is None or (reason := distributed.lost_peer(e)) is None:
            raise
        raise click.ClickException(f"rank {group.rank()}: lost the connection to another rank ({reason})") from None
    if canvas_view:
        canvas_view.close()
    else:
        click.echo()
    if verbose:
        click.echo(statistics(responses))


def _plan_key(plan: Plan) -> tuple:
    return plan.mode, plan.settings.freeze_after, plan.draft_length, plan.draft_steps


def _generate_cli(model, prompt, system_prompt, max_tokens, steps, entropy_bound, temp_min, temp_max, seed,
                  ignore_chat_template, verbose, view, policy, draft_length, draft_steps, temp, template_file,
                  prefill_step_size, schema_file, image_files, group, watchdog, adapter_path=None):
    """The CLI's work on one rank: the model (or this rank's share of it), the text as it commits."""
    from . import distributed
    from .loader import load
    from .view import CanvasView

    if prompt == "-":
        stdin = getattr(sys.stdin, "buffer", None)
        prompt = decode_utf8(stdin.read(), "the prompt on stdin") if stdin else sys.stdin.read()
    check_text(prompt, "--prompt")
    if system_prompt is not None:
        check_text(system_prompt, "--system-prompt")
    check_request(prompt, max_tokens or 1, seed, system_prompt)  # before the model loads
    images = [load_image(path) for path in image_files] or None  # bad files fail before the model loads
    if group is None:
        dgemma, tokenizer = load(model or DEMO_MODEL, adapter_path=adapter_path)
    elif adapter_path:
        raise ValueError("adapters are not applied to a sharded model yet; merge them first: python -m mlx_dgemma.fuse")
    else:
        dgemma, tokenizer = distributed.sharded_load(model or DEMO_MODEL, group, watchdog)
    defaults = generation_config(dgemma, tokenizer)
    check_step_counts(defaults, steps, draft_steps, ("--steps", "--draft-steps"))  # before a schema's draft runs
    template = _read_template(tokenizer, template_file, schema_file, dgemma.config.max_position_embeddings)
    if isinstance(template, dict):  # a schema: holes sized by a free draft first
        template = drafted_json_template(
            dgemma, tokenizer, prompt, template, max_tokens=max_tokens, seed=seed, steps=steps,
            entropy_bound=entropy_bound, temp_min=temp_min, temp_max=temp_max, system_prompt=system_prompt,
            policy=policy, chat_template=not ignore_chat_template, images=images)
    canvas_view = CanvasView(tokenizer, steps or defaults.max_denoising_steps) if view else None
    responses = []
    for response in stream_generate(
        dgemma, tokenizer, prompt, max_tokens, seed=seed, steps=steps, entropy_bound=entropy_bound,
        temp_min=temp_min, temp_max=temp_max, system_prompt=system_prompt, policy=policy, template=template,
        chat_template=not ignore_chat_template, on_step=canvas_view.step if canvas_view else None,
        temperature=temp, draft_length=draft_length, draft_steps=draft_steps,
        prefill_step_size=prefill_step_size, images=images,
    ):
        if verbose and (not responses or _plan_key(response.plan) != _plan_key(responses[-1].plan)):
            click.echo(response.plan.explain(), err=True)  # auto may re-plan between canvases/rounds
        if canvas_view:
            canvas_view.commit(response.text)
        else:
            sys.stdout.write(response.text)
            sys.stdout.flush()
        responses.append(response)
    return responses, canvas_view


def _read_template(tokenizer, template_file: str | None, schema_file: str | None, limit: int):
    """The --template file's template, or the --schema file's schema (checked); ``limit`` is the
    model's context, which no template can outgrow."""
    from .template import json_template

    path = template_file or schema_file
    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise TemplateError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise TemplateError(f"{path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                            "save it as UTF-8") from None
    if template_file:
        return parse_template(tokenizer, text.removesuffix("\n"), limit=limit)  # the newline that ends the file
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise TemplateError(f"{path} is not JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None
    except RecursionError:
        raise TemplateError(f"{path} is nested too deeply to read; flatten the schema") from None
    json_template(tokenizer, schema, limit=limit)  # a bad schema fails here, before any generation
    return schema


if __name__ == "__main__":
    main()
