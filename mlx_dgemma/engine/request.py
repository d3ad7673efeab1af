"""A request made ready: ``plan`` takes one ``resolve`` settled (resolve.py) and makes the part that
needs the device: the device profile, the plan (the auto planner's first choice), the draws and the
text decoder; ``prepare`` is the two in turn. ``generation_device`` is where generation runs. The
engine (batch.py) runs what ``plan`` returns.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import mlx.core as mx

from ..errors import OptionError
from ..model.config import GenerationConfig
from ..options import GenerationArgs
from ..structured.grammar import Grammar
from ..structured.template import CanvasTemplate, canvas_clamps
from ..tokenizer import TextStream, Tokenizer
from .drafting import DraftSettings
from .filters import filtering
from .policy import (
    PLANNERS,
    AutoPlanner,
    DraftRequest,
    Plan,
    auto_planner,
    cached_profile,
    live_profile_store,
    make_plan,
)
from .resolve import ResolvedRequest, resolve
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


def cut_at_stop(canvas: list[int], stop_ids) -> tuple[list[int], bool]:
    """The canvas up to and including its first stop id, and whether there was one."""
    for i, token in enumerate(canvas):
        if token in stop_ids:
            return canvas[: i + 1], True
    return canvas, False


@dataclass
class PreparedRequest:
    """One prompt made ready to generate: its ids, plan (with the sampler settings), draws and text
    decoder. A drafted schema's (``drafting``) generates its free draft first; the engine then plans
    the answer on the template the draft sizes (``resolved.answered``)."""

    resolved: ResolvedRequest
    plan: Plan
    rng: Random
    text: object  # the answer's decoder (ResolvedRequest.text_decoder)
    planner: AutoPlanner | None = None  # the auto policy's, which re-plans at every canvas or round
    acceptance: object = None  # verified drafting's running estimate (policy.Acceptance)
    thought: TextStream | None = None  # with think: the thought channel's text, handed out as it grows

    @property
    def ids(self) -> list[int]:
        return self.resolved.ids

    @property
    def max_tokens(self) -> int:
        return self.resolved.max_tokens

    @property
    def defaults(self) -> GenerationConfig:
        return self.resolved.defaults

    @property
    def overrides(self) -> dict:
        return self.resolved.overrides

    @property
    def stop_ids(self) -> frozenset[int]:
        return self.resolved.stop_ids

    @property
    def end_of_turn(self) -> int | None:
        return self.resolved.end_of_turn

    @property
    def vision_inputs(self) -> dict:
        return self.resolved.vision_inputs

    @property
    def template(self) -> CanvasTemplate | None:
        return self.resolved.template

    @property
    def grammar(self) -> Grammar | None:
        return self.resolved.layout.grammar

    @property
    def drafting(self) -> bool:
        return self.resolved.layout.kind == "drafted"

    @property
    def temperature(self) -> float:
        """ar and verified sampling (0: greedy); diffusion's is in plan.settings."""
        return self.resolved.args.sampling.temperature or 0.0

    def canvas_clamps(self, tokenizer: Tokenizer, config):
        """The template's (length, Clamp) per canvas, or None without a template."""
        if self.template is None:
            return None
        return canvas_clamps(
            self.template,
            tokenizer,
            config.vocab_size,
            config.canvas_length,
            self.end_of_turn,
            self.plan.last_canvas_length,
        )


def prepare(model, tokenizer: Tokenizer, prompt: str | list[int], args: GenerationArgs) -> PreparedRequest:
    """Check a request and make it ready (``resolve``, then ``plan``; see ``api.stream_generate``)."""
    return plan(model, tokenizer, resolve(model, tokenizer, prompt, args))


def plan(model, tokenizer: Tokenizer, resolved: ResolvedRequest) -> PreparedRequest:
    """Make a resolved request ready on the device that runs it: its profile and plan, its draws
    (seeded, or the caller's ``rng``) and its text decoders."""
    args, config = resolved.args, model.config
    template, grammar = resolved.template, resolved.layout.grammar
    temperature = args.sampling.temperature or 0.0
    planner, acceptance, chosen = _policy_plan(
        model, resolved.defaults, args, template or grammar, resolved.max_tokens, resolved.overrides, resolved.ids
    )
    if chosen.settings.penalizing and args.policy != "ar":
        name = _given(args, _PENALTIES) or "a penalty"
        raise OptionError(
            f"{name} applies to autoregressive decoding only (policy ar): a denoising step draws "
            "tokens in no order, and verified drafting's exact sampling does not take it; take policy "
            "ar or leave it out",
            name,
        )
    if (
        template is not None
        and chosen.mode != "diffusion"
        and (temperature or filtering(*chosen.settings.filters) or chosen.settings.penalizing)
    ):
        raise OptionError(
            f"templates decode greedily under {chosen.policy}; drop the temperature, the filters and "
            "the penalties, or take a diffusion policy",
            _given(args, ("temperature", *_FILTERS, *_PENALTIES)),
        )
    if chosen.mode == "verified":
        DraftSettings(chosen.draft_length, chosen.draft_steps, temperature).check(config.canvas_length)
    rng = MxRandom(args.seed) if args.rng is None else args.rng
    thought = TextStream(tokenizer, set(resolved.stop_ids), thought=True) if args.think else None
    return PreparedRequest(resolved, chosen, rng, resolved.text_decoder(tokenizer), planner, acceptance, thought)


_FILTERS = ("top_p", "top_k", "min_p")
_PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")


def _given(args: GenerationArgs, names: tuple[str, ...]) -> str | None:
    """The first of the sampling options ``names`` that ``args`` sets."""
    return next((name for name in names if getattr(args.sampling, name) is not None), None)


def _policy_plan(
    model, defaults: GenerationConfig, args: GenerationArgs, layout, max_tokens: int, overrides: dict, ids: list[int]
) -> tuple[AutoPlanner | None, object, Plan]:
    """The request's auto planner (auto without a template or grammar: it re-plans at every canvas,
    block or round), verified drafting's running acceptance estimate, and its first plan. Under a
    grammar a diffusion policy drafts and verifies (verified drafting): the grammar decides each
    token as the encoder verifies it."""
    policy, profile = args.policy, args.profile
    if isinstance(layout, Grammar) and policy != "ar":
        policy = "verified"
    store = None  # a profile of the caller's is fixed; the cached one is refreshed from the forwards run
    if profile is None and (policy == "auto" or policy == "verified" and None in (args.draft_length, args.draft_steps)):
        profile = cached_profile(model)
        store = live_profile_store(model)
    if policy == "auto" and layout is None:
        planner = (
            AutoPlanner(defaults, model.config.canvas_length, profile, args.expected_steps)
            if args.expected_steps
            else auto_planner(model, defaults, profile, store)
        )
        return planner, None, planner.choose(max_tokens, overrides, prompt=ids)  # from answers to prompts like it
    acceptance = PLANNERS.acceptance(model) if policy == "verified" and profile else None
    plan = make_plan(
        policy,
        defaults,
        model.config.canvas_length,
        max_tokens,
        profile,
        args.expected_steps,
        DraftRequest(args.draft_length, args.draft_steps, acceptance),
    )
    if policy != args.policy:
        plan = replace(
            plan,
            policy=args.policy,
            reasons=[
                f"{args.policy} with a schema the canvas template does not take: verified drafting under its grammar"
            ]
            + plan.reasons,
        )
    return None, acceptance, plan.overridden(overrides)
