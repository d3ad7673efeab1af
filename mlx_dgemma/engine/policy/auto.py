"""The auto policy: a planner that re-chooses the plan with the most predicted tokens per second
before every canvas, block or round from the device profile and what the model has done so far,
and ``make_plan``, the plan of any policy."""

from __future__ import annotations

import math
import statistics
import weakref
from collections import deque
from dataclasses import replace

from ...model.config import GenerationConfig
from .acceptance import Acceptance, best_draft
from .observed import CONFIRM, LiveProfile
from .plan import DraftRequest, Plan, fixed_plan, verified_plan
from .profile import Profile

# Share of canvas positions the fast policy computes per step (active-set compaction): 74 of 144 on
# the demo tasks (benchmarks/demo_speed.py).
FAST_POSITION_SHARE = 0.5
# auto expects an answer's length from this many recent answers to prompts like its own; it keeps the
# last OBSERVATIONS_KEPT of each thing it observes, and a prompt's first PROMPT_KEY ids say what it is like
ANSWERS_KEPT = 8
OBSERVATIONS_KEPT = 64
PROMPT_KEY = 256
# canvases of each diffusion plan it takes to tell how many steps fast saves
SAVED_SEEN = 3
# auto runs a plan again after this many choices without it, if predicted within this share of the best
EXPLORE_EVERY = 16
EXPLORE_WITHIN = 0.8
# With a live profile, a kind of forward (step, verify, ar) that has never been observed is run once if
# its plan is predicted within this share of the best: a cached time 10x wrong is found out at once.
PROBE_WITHIN = 0.1
KIND = {"reference": "step", "fast": "step", "verified": "verify", "ar": "ar"}


class AutoPlanner:
    """The auto policy: before each canvas, AR block or verified round, the plan with the most predicted
    tokens per second among reference, fast, ar and verified, from the device profile and what this
    model has done so far; the estimates are updated as it generates, so a plan that turns out slower
    than predicted is left for the next best at the next canvas or round.

    Predicted tok/s: reference = tokens per canvas / (steps per canvas · step time at the canvas); fast
    = the same at ``FAST_POSITION_SHARE`` of the canvas's positions; ar = 1 / token time; verified =
    tokens per round / (draft steps · step time at the draft length + the verifying pass), at the draft
    length and steps ``best_draft`` picks from the acceptance estimate, scaled by the observed ratio of
    tokens per round to the model's. A canvas or round gives no more tokens than the answer is expected
    still to have, from the lengths of earlier answers (``expected_tokens``). A canvas that the answer
    is expected to go on from also pays its commit's encode. Each prediction times that plan's pace: the
    seconds the profile gives the work a canvas, block or round of it did over the seconds that work
    took (time only: steps, answer lengths and tokens per round have their own estimates).

    Answer lengths, steps per canvas (from a prior of the generation config: a quarter of the step
    limit, at least the stability threshold + 1, until one is observed; optimistic on a prompt's own
    canvases, ``_pooled``), tokens per round (a ratio to the model's: its geometric mean) and pace are
    each the mean of the latest ~8 observations on prompts like this one (``PromptLikeMeans``: a task's
    instructions, a conversation's earlier turns), so one task's do not stand for another's. A plan
    not run for ``EXPLORE_EVERY`` choices but predicted within ``EXPLORE_WITHIN`` of the best is run
    once more, so estimates follow a change of task; a task whose canvases were never seen runs one
    once it has been answered, if one at other tasks' steps is predicted within ``EXPLORE_WITHIN`` of
    the best (``untried``); and while fewer than ``CONFIRM`` of a task's canvases were seen, one
    within ``EXPLORE_WITHIN`` of a best of another kind is run to confirm them.

    With ``live`` (a ``LiveProfile``) the times of the forwards it runs alone refresh the profile the
    predictions come from (in place of the paces), and a kind of forward never observed is run once (a
    probe) if predicted within ``PROBE_WITHIN`` of the best; without, ``profile`` is fixed and the
    choices are deterministic in it and the pace."""

    def __init__(
        self,
        gen: GenerationConfig,
        canvas: int,
        profile: Profile,
        expected_steps: float | None = None,
        live: LiveProfile | None = None,
    ):
        self.gen, self.canvas, self.profile, self.live = gen, canvas, profile, live
        prior = expected_steps or max(gen.stability_threshold + 1, gen.max_denoising_steps / 4)
        # steps per canvas: what was observed, as soon as it is (the prior only stands in until then)
        self.prompts = PromptKinds()  # the prompts answered, which say what a prompt is like
        self.steps = {name: PromptLikeMeans(prior, 0.0, kinds=self.prompts) for name in ("reference", "fast")}
        self.lengths = PromptLikeMeans(float(canvas), window=ANSWERS_KEPT, kinds=self.prompts)  # answer lengths
        self.acceptance = Acceptance()
        # observed / modelled tokens per round, from 0.05 (add's drafts: one token of 14 modelled) to 2: a
        # ratio, so its geometric mean (at the arithmetic one, a first add round still predicts 7 tokens)
        self.round_yield = PromptLikeMeans(1.0, kinds=self.prompts, geometric=True)
        # seconds the profile gives a plan's work / seconds it took
        self.pace = {name: PromptLikeMeans(1.0, kinds=self.prompts) for name in ("reference", "fast", "ar", "verified")}
        self.idle = {name: 0 for name in self.pace}  # choices since each plan last ran
        self._probing: str | bool = False  # the kind a probe is out for (one at a time)

    @property
    def current(self) -> Profile:
        """The profile predictions are made from: the live one, where the planner keeps one."""
        return self.live.profile if self.live is not None else self.profile

    def steps_per_canvas(self, name: str, prompt: list[int] | tuple[int, ...] = (), hopeful: bool = False) -> float:
        """Steps a canvas of ``name`` (reference or fast) is expected to take, from the canvases of
        both on prompts like ``prompt`` (else the prior): a prompt takes about as many steps under
        either, but for the confirming steps fast's stop rule saves (the stability threshold at most;
        what is observed once both have canvases enough to tell), optimistically where they are its
        own (``_pooled``). A prompt unlike all of those takes what they took halfway to the prior
        (``hopeful``: what they took)."""
        ref, fast = self.steps["reference"].observed(prompt), self.steps["fast"].observed(prompt)
        ref_like, fast_like = self.steps["reference"].like(prompt), self.steps["fast"].like(prompt)
        if ref_like != fast_like:  # one plan's canvases on prompts like it: not the other's on other prompts
            ref, fast = (ref, []) if ref_like else ([], fast)
        if not ref and not fast:
            return self.steps[name].prior
        if not ref_like and not fast_like:
            pooled = self._pooled(name, ref, fast, optimistic=False)
            if not hopeful and self.untried(prompt):
                # A prompt unlike every one whose canvases were seen may be as hard as the step limit
                # allows (an add canvas of the demo takes 4-24 steps, a sort one 1-3): midway between
                # what those took and the prior.
                return (pooled + self.steps[name].prior) / 2
            return pooled
        return self._pooled(name, ref, fast, optimistic=True)

    def _own_canvases(self, prompt: list[int] | tuple[int, ...] = ()) -> int:
        """How many canvases (of either plan) on prompts like ``prompt`` its steps are estimated from."""
        return sum(len(self.steps[name].observed(prompt)) for name in self.steps if self.steps[name].like(prompt))

    def untried(self, prompt: list[int] | tuple[int, ...] = ()) -> bool:
        """Whether ``prompt`` is unlike every prompt whose canvases were seen (another task's): like none
        of either plan's, and unlike those of one (the other's may be a few of several tasks)."""
        ref, fast = self.steps["reference"], self.steps["fast"]
        return not ref.like(prompt) and not fast.like(prompt) and (ref.unlike(prompt) or fast.unlike(prompt))

    def _pooled(self, name: str, ref: list[float], fast: list[float], optimistic: bool) -> float:
        """Steps per canvas of ``name`` from canvases of both plans; ``optimistic`` (a prompt's own
        canvases): the mean less its standard error, no less than the fewest steps seen, with the prior
        standing in for the canvases short of ``CONFIRM`` while they took more. A plan planned too slow
        for a task is not run on it, so nothing would correct it: at the mean, one canvas at the step
        limit (a json canvas of the demo takes 1-5 steps, 24 now and then) keeps fast off json."""
        saved = float(self.gen.stability_threshold)
        if len(ref) >= SAVED_SEEN and len(fast) >= SAVED_SEEN:
            saved = min(saved, max(0.0, sum(ref) / len(ref) - sum(fast) / len(fast)))
        values = ref + [n + saved for n in fast]  # in the reference's steps
        pooled = sum(values) / len(values)
        if optimistic:
            prior = self.steps["reference"].prior
            if len(values) < CONFIRM and pooled > prior:
                values += [prior] * (CONFIRM - len(values))
                pooled = sum(values) / len(values)
            if len(values) > 1:
                pooled = max(min(values), pooled - statistics.stdev(values) / math.sqrt(len(values)))
        return pooled if name == "reference" else max(1.0, pooled - saved)

    def answers(self, prompt: list[int] | tuple[int, ...] = ()) -> list[int]:
        """Lengths of the ``ANSWERS_KEPT`` answers to the prompts that begin most like ``prompt``."""
        return [int(n) for n in self.lengths.observed(prompt)]

    def expected_tokens(self, produced: int, prompt: list[int] | tuple[int, ...] = ()) -> float:
        """Tokens an answer to ``prompt`` that has ``produced`` so far is expected still to give: the
        mean of what the earlier answers longer than that gave past it; when none is, as many as it
        has already (an answer past every earlier length is as likely to end soon as to run on), or a
        canvas before it has any."""
        longer = [n - produced for n in self.answers(prompt) if n > produced]
        return sum(longer) / len(longer) if longer else float(produced or self.canvas)

    def predictions(
        self, remaining: int, produced: int = 0, prompt: list[int] | tuple[int, ...] = (), hopeful: bool = False
    ) -> dict[str, tuple[float, str]]:
        """Predicted tok/s of each plan and why, for the next canvas, block or round of an answer to
        ``prompt`` (``hopeful``: a canvas on a prompt unlike those seen takes the steps they took)."""
        p, C = self.current.at_prefix(len(prompt) + produced), self.canvas  # the context at hand
        expected = self.expected_tokens(produced, prompt)
        tokens = min(expected, remaining, C)
        length, steps, verified = best_draft(p, self.acceptance, C)
        out = {}
        goes_on = min(expected, remaining) > C  # the answer goes on past the canvas: its commit is encoded
        for name in ("reference", "fast"):
            positions = _positions(name, C)
            n = self.steps_per_canvas(name, prompt, hopeful)
            out[name] = (
                tokens / _canvas_s(p, n, positions, C, goes_on),
                f"{n:.1f} steps per canvas x {p.step_s(positions) * 1e3:.2f} ms per step of {positions} computed "
                f"positions{f' + {p.verify_s(C) * 1e3:.2f} ms commit encode' if goes_on else ''}, "
                f"{tokens:.1f} tokens per canvas",
            )
        out["ar"] = (p.ar_tok_s, f"{p.ar_token_s * 1e3:.2f} ms per token")
        modelled = self.acceptance.tokens_per_round(steps, length)
        rest = max(1.0, min(expected, remaining))
        per_round = min(modelled * self.round_yield.value(prompt), rest)
        # a round costs as much however few tokens are left, so the rest of the answer is what is paid
        # for: 18 tokens at 13 a round are two rounds, 9 tokens each
        per_round = rest / math.ceil(rest / per_round - 1e-9)
        out["verified"] = (
            verified * per_round / modelled,
            f"drafts of {length} in {steps} step(s), {(steps * p.step_s(length) + p.verify_s(length)) * 1e3:.2f} ms "
            f"per round, {per_round:.1f} tokens per round ({self.acceptance.describe()})",
        )
        paces = {name: self.pace[name].value(prompt) for name in out}
        return {
            name: (
                tok_s * paces[name],
                why + (f", x{paces[name]:.2f} as observed" if self.pace[name].observed(prompt) else ""),
            )
            for name, (tok_s, why) in out.items()
        }

    def choose(
        self, remaining: int, overrides: dict | None = None, produced: int = 0, prompt: list[int] | tuple[int, ...] = ()
    ) -> Plan:
        """The next plan for an answer to ``prompt`` that has ``produced`` tokens and room for
        ``remaining`` more, with the caller's sampler ``overrides`` (``Plan.overridden``) applied. The
        plan carries what was chosen and its predicted tok/s (``Plan.predicted``): what it gives is
        observed against that, per answer, whatever other answers choose meanwhile."""
        predicted = self.predictions(remaining, produced, prompt)
        best = max(predicted, key=lambda name: predicted[name][0])
        # Estimates of a plan that does not run do not move: one close enough to the best is run again
        # now and then, so a change of task (or a wrong prior) cannot keep auto on a worse plan. A
        # canvas on a prompt unlike those whose canvases were seen (a new task: several times the
        # steps, or a fraction) is not; once the task has been answered, it is run once if a canvas at
        # the steps the others took is predicted close to the best: else an easy task's canvases are
        # never observed.
        untried = self.untried(prompt)
        stale = [
            name
            for name in predicted
            if self.idle[name] >= EXPLORE_EVERY
            and predicted[name][0] >= EXPLORE_WITHIN * predicted[best][0]
            and not (untried and KIND[name] == "step")
        ]
        # A task's steps per canvas seen fewer than CONFIRM times (one canvas of it in a warm-up, say) may
        # be off by the step that decides (a reverse canvas takes 1, a sort one 2): while another kind is
        # the best, a canvas close to it is run until CONFIRM agree, not left for a retry.
        confirm = None
        if KIND[best] != "step" and 0 < self._own_canvases(prompt) < CONFIRM:
            confirm = max(("reference", "fast"), key=lambda name: predicted[name][0])
            confirm = confirm if predicted[confirm][0] >= EXPLORE_WITHIN * predicted[best][0] else None
        retry = max(stale, key=lambda name: predicted[name][0]) if stale else None
        trial = None
        if untried and self.lengths.like(prompt):
            hopeful = self.predictions(remaining, produced, prompt, hopeful=True)
            trial = max(("reference", "fast"), key=lambda name: hopeful[name][0])
            # (within EXPLORE_WITHIN, as a retry: a short answer's single verified round and a canvas at
            # the other tasks' steps are predicted within a few percent of each other)
            trial = trial if trial != best and hopeful[trial][0] >= EXPLORE_WITHIN * predicted[best][0] else None
        # A kind of forward the live profile has not yet seen is run once, so that a cached time far
        # off (too slow, so never chosen) is measured rather than believed.
        unseen = self.live.observed_kinds() if self.live is not None else None
        probes = [
            name
            for name in predicted
            if unseen is not None
            and KIND[name] not in unseen | {KIND[best]}  # (the best's own kind is observed as it runs)
            and predicted[name][0] >= PROBE_WITHIN * predicted[best][0]
        ]
        probe = max(probes, key=lambda name: predicted[name][0]) if probes and not self._probing else None
        for name in self.idle:
            self.idle[name] += 1
        best = probe or trial or retry or confirm or best
        self.idle[best] = 0
        if probe:
            self._probing = KIND[probe]
        profile = self.current
        plan = fixed_plan(best, self.gen, self.canvas, profile)
        if best == "verified":
            plan = verified_plan(plan, self.canvas, profile, DraftRequest(acceptance=self.acceptance))
        reasons = [f"{profile.device} ({profile.source}), predicted tok/s:"]
        reasons += [
            f"{name}: {tok_s:.1f} ({why})"
            for name, (tok_s, why) in sorted(predicted.items(), key=lambda item: -item[1][0])
        ]
        if probe:
            why = f" (its {KIND[probe]} time not yet observed on this device: run once to measure it)"
        elif trial:
            why = (
                " (no canvas yet on prompts like this one, predicted within "
                f"{1 / EXPLORE_WITHIN:.1f}x of the best at the steps of others: run once)"
            )
        elif retry:
            why = (
                f" (not run for {EXPLORE_EVERY}+ choices and predicted within "
                f"{1 / EXPLORE_WITHIN:.1f}x of the best: run again to check)"
            )
        elif confirm:
            why = (
                f" (fewer than {CONFIRM} canvases yet on prompts like this one, predicted within "
                f"{1 / EXPLORE_WITHIN:.1f}x of the best: run to confirm their steps)"
            )
        else:
            why = ""
        reasons.append(f"→ {best}{why}; re-chosen at every canvas or round as the estimates move")
        chosen = (best, predicted[best][0] / self.pace[best].value(prompt))  # before its pace
        return replace(
            plan,
            policy="auto",
            reasons=reasons,
            predicted=chosen,
            context=len(prompt) + produced,
            predictions=tuple(
                (name, tok_s, w) for name, (tok_s, w) in sorted(predicted.items(), key=lambda i: -i[1][0])
            ),
            why=why.split(":")[0] + ")" if why else "",
            exploring=bool(why),
        ).overridden(overrides or {})

    def observe_canvas(
        self,
        plan: Plan,
        steps: int,
        seconds: float | None = None,
        tokens: int | None = None,
        prompt: list[int] | tuple[int, ...] = (),
        alone: bool = True,
        encoded: bool = True,
    ) -> None:
        """A canvas denoised under ``plan`` took ``steps`` steps and gave ``tokens`` in ``seconds``,
        its commit's encode included if ``encoded`` (the answer went on) (``alone``: its forwards were
        its own, so the live profile learns from their time)."""
        policy = "fast" if plan.settings.freeze_after else "reference"
        self.steps[policy].add(steps, prompt)
        # a fast canvas's steps compute about FAST_POSITION_SHARE of its positions (its commit all of them)
        positions = _positions(policy, self.canvas)
        taken = self.live is not None and alone and bool(seconds and steps and plan.predicted)
        if taken:
            self.live.observe_canvas(positions, steps, plan.context, seconds, self.canvas if encoded else 0)
        at = self.current.at_prefix(plan.context)
        self._pace(plan, policy, _canvas_s(at, steps, positions, self.canvas, encoded), seconds, prompt, taken)

    def observe_ar(
        self,
        plan: Plan,
        tokens: int,
        seconds: float | None = None,
        prompt: list[int] | tuple[int, ...] = (),
        alone: bool = True,
    ) -> None:
        """An autoregressive block under ``plan`` gave ``tokens`` in ``seconds``."""
        taken = self.live is not None and alone and bool(seconds and tokens and plan.predicted)
        if taken:
            self.live.observe_ar(tokens, plan.context, seconds)
        self._pace(plan, "ar", tokens * self.current.at_prefix(plan.context).ar_token_s, seconds, prompt, taken)

    def observe_round(
        self,
        plan: Plan,
        done,
        seconds: float | None = None,
        prompt: list[int] | tuple[int, ...] = (),
        alone: bool = True,
    ) -> None:
        """A verified round under ``plan`` (``done``: a ``drafting.Round``); one that ended the answer
        (no next token) says how long the answer was, not how well drafts are accepted."""
        modelled = self.acceptance.tokens_per_round(plan.draft_steps, done.length)
        self.acceptance.observe(plan.draft_steps, done.length, done.kept, done.rejected)
        if done.known is not None:
            self.round_yield.add(len(done.tokens) / modelled, prompt)
        taken = self.live is not None and alone and bool(seconds and plan.predicted)
        if taken:
            self.live.observe_round(done.length, plan.draft_steps, plan.context, seconds)
        at = self.current.at_prefix(plan.context)
        round_s = plan.draft_steps * at.step_s(done.length) + at.verify_s(done.length)
        self._pace(plan, "verified", round_s, seconds, prompt, taken)

    def observe_answer(self, tokens: int, prompt: list[int] | tuple[int, ...] = ()) -> None:
        """An answer to ``prompt`` ended after ``tokens`` tokens."""
        self.prompts.add(prompt)
        self.lengths.add(tokens, prompt)

    def _pace(
        self, plan: Plan, name: str, predicted_s: float, seconds: float | None, prompt, taken: bool = False
    ) -> None:
        """The pace of a canvas, block or round of ``name``: the seconds the current profile gives the
        work it did (the steps it took, the tokens it decoded, the round it ran) over the seconds it
        took. Only time is compared: how many steps a canvas takes, how many tokens an answer or a
        round gives, are estimated on their own, so a short answer does not read as a slow plan. It
        corrects a fixed profile (fast's share of positions, the row's work between forwards) and a
        live one for forwards shared with other rows; seconds the live profile has ``taken`` in, point
        by point, are not counted twice."""
        if self._probing == KIND[name]:
            self._probing = False
        if taken:
            return
        if not seconds or not predicted_s or plan.predicted is None or plan.predicted[0] != name:
            return
        self.pace[name].add(min(4.0, max(0.25, predicted_s / seconds)), prompt)


class PromptKinds:
    """The prompts of the latest answers, which say what a prompt is like: the prompts that share more
    of its beginning than every one of them does (the same instructions, a conversation's earlier
    turns, not just the template)."""

    def __init__(self):
        self.keys: deque[tuple[int, ...]] = deque(maxlen=OBSERVATIONS_KEPT)
        self._common: dict[tuple[int, ...], int] = {}

    def add(self, prompt: list[int] | tuple[int, ...]) -> None:
        self.keys.append(tuple(prompt[:PROMPT_KEY]))
        self._common.clear()

    def common(self, key: tuple[int, ...]) -> int:
        """How much of ``key``'s beginning every prompt answered shares with it."""
        if key not in self._common:  # (asked by every estimate, at every choice)
            self._common[key] = min((_common_prefix(key, past) for past in self.keys), default=0)
        return self._common[key]


class PromptLikeMeans:
    """One quantity observed along with the prompt each observation came from, estimated from the
    latest ``window`` observations on prompts like the one at hand (those that share more of its
    beginning than ``kinds``, the prompts answered, all do), or on any prompt when none is like it,
    after a prior worth ``prior_weight`` observations until there are ``window``. A new kind of prompt
    starts from what the others gave and is estimated from its own observations from the first on."""

    def __init__(
        self,
        prior: float,
        prior_weight: float = 1.0,
        window: int = 8,
        kinds: PromptKinds | None = None,
        geometric: bool = False,
    ):
        self.prior, self.prior_weight, self.window, self.geometric = prior, prior_weight, window, geometric
        self.kinds = kinds if kinds is not None else PromptKinds()
        self.records: deque[tuple[tuple[int, ...], float]] = deque(maxlen=OBSERVATIONS_KEPT)
        # per prompt key, until the next observation: (observed, from prompts like it, unlike all of those)
        self._observed: dict[tuple[int, ...], tuple[list[float], bool, bool]] = {}

    def add(self, value: float, prompt: list[int] | tuple[int, ...] = ()) -> None:
        self.records.append((tuple(prompt[:PROMPT_KEY]), value))
        self._observed.clear()

    def observed(self, prompt: list[int] | tuple[int, ...] = ()) -> list[float]:
        """The latest ``window`` observations on prompts like ``prompt``, oldest first."""
        return self._estimate(prompt)[0]

    def like(self, prompt: list[int] | tuple[int, ...] = ()) -> bool:
        """Whether ``observed(prompt)`` came from prompts like ``prompt``."""
        return self._estimate(prompt)[1]

    def unlike(self, prompt: list[int] | tuple[int, ...] = ()) -> bool:
        """Whether ``prompt`` is unlike every prompt behind ``observed(prompt)``: none is like it, and
        most of those share more of their beginning with another of them than any does with it
        (another task's instructions; prompts that share only a chat template are not unlike)."""
        return self._estimate(prompt)[2]

    def _estimate(self, prompt) -> tuple[list[float], bool, bool]:
        key = tuple(prompt[:PROMPT_KEY])
        if key not in self._observed:
            shared = [_common_prefix(key, past) for past, _ in self.records]
            floor = min(self.kinds.common(key), min(shared, default=0))
            like = [value for n, (_, value) in zip(shared, self.records) if n > floor]
            if like:
                self._observed[key] = (like[-self.window :], True, False)
            else:
                kept = list(self.records)[-self.window :]
                # what most of their prompts share with the nearest other: a task's instructions, if any
                # (one prompt of another kind among them does not hide those, nor does a first word two
                # of a task's prompts happen to share; an answer's canvases share its prompt)
                prompts = list(dict.fromkeys(past for past, _ in kept))
                nearest = sorted(
                    max((_common_prefix(a, b) for j, b in enumerate(prompts) if j != i), default=0)
                    for i, a in enumerate(prompts)
                )
                unlike = bool(kept) and max(shared[-self.window :]) < nearest[(len(nearest) - 1) // 2]
                self._observed[key] = ([value for _, value in kept], False, unlike)
        return self._observed[key]

    def value(self, prompt: list[int] | tuple[int, ...] = ()) -> float:
        """The mean of ``observed(prompt)`` and the prior (the geometric mean, for a positive ratio)."""
        seen = self.observed(prompt)
        weight = self.prior_weight if len(seen) < self.window else 0.0
        if not (weight or seen):
            return self.prior
        if self.geometric:
            logs = math.log(self.prior) * weight + sum(math.log(max(v, 1e-6)) for v in seen)
            return math.exp(logs / (weight + len(seen)))
        return (self.prior * weight + sum(seen)) / (weight + len(seen))


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _canvas_s(p: Profile, steps: float, positions: int, canvas: int, encoded: bool) -> float:
    """Seconds of a canvas of ``steps`` steps of ``positions`` computed positions, and of its commit's
    encode (a pass over the canvas, like a verifying one) if the answer goes on past it."""
    return steps * p.step_s(positions) + (p.verify_s(canvas) if encoded else 0.0)


def _positions(name: str, canvas: int) -> int:
    """Positions a step of ``name`` (reference or fast) computes on a canvas of ``canvas``."""
    return canvas if name == "reference" else max(1, round(FAST_POSITION_SHARE * canvas))


class Planners:
    """Each model's auto planner, kept across generations so that what one generation saw informs the
    next, and the verified policy's acceptance estimate, each let go with the model."""

    def __init__(self):
        self.by_model: dict[int, AutoPlanner] = {}
        # The verified policy's drafts start from the previous draft's rest and a grammar's rows draft
        # under it, auto's afresh: neither's acceptance stands for the other's.
        self.drafting: dict[int, Acceptance] = {}

    def get(self, model) -> AutoPlanner | None:
        return self.by_model.get(id(model))

    def set(self, model, planner: AutoPlanner | None) -> None:
        """Keep ``planner`` as the model's (None: forget the model's planner and acceptance)."""
        key = id(model)
        if planner is None:
            self.by_model.pop(key, None)
            self.drafting.pop(key, None)
            return
        self._let_go_with(model)
        self.by_model[key] = planner

    def acceptance(self, model) -> Acceptance:
        """The verified policy's running acceptance estimate for this model."""
        key = id(model)
        if key not in self.drafting:
            self._let_go_with(model)
            self.drafting[key] = Acceptance()
        return self.drafting[key]

    def _let_go_with(self, model) -> None:
        key = id(model)
        if key not in self.by_model and key not in self.drafting:
            weakref.finalize(model, self._forget, key)

    def _forget(self, key: int) -> None:
        self.by_model.pop(key, None)
        self.drafting.pop(key, None)


PLANNERS = Planners()


def auto_planner(model, gen: GenerationConfig, profile: Profile, store=None) -> AutoPlanner:
    """This model's planner for ``profile`` (``PLANNERS``). With ``store`` (a function that caches a
    profile) its profile is live: refreshed from the forwards it runs, and stored where they disagree
    with it (``LiveProfile``); without, ``profile`` is fixed and planning deterministic in it."""
    planner = PLANNERS.get(model)
    if planner is None or profile not in (planner.profile, planner.live and planner.live.cached):
        live = LiveProfile(profile, store) if store is not None else None
        planner = AutoPlanner(gen, model.config.canvas_length, profile, live=live)
        PLANNERS.set(model, planner)
    elif store is not None and planner.live is None:  # made first for a caller's profile, the same one
        planner.live = LiveProfile(profile, store)
    return planner


def make_plan(
    policy: str,
    gen: GenerationConfig,
    canvas: int,
    max_tokens: int,
    profile: Profile | None = None,
    expected_steps: float | None = None,
    draft: DraftRequest = DraftRequest(),
) -> Plan:
    """Turn a policy name, the generation config, the request and the device profile into a plan.
    ``draft``: what a verified request asks of its drafts (its acceptance estimate is the model's, see
    ``auto_planner``).

    ``expected_steps`` is how many steps a canvas typically takes with this model (the stop rule
    usually fires well before the limit); without it the step limit is assumed.
    """
    if policy != "auto":
        return fixed_plan(policy, gen, canvas, profile, draft)
    if profile is None:
        reference = replace(fixed_plan("reference", gen, canvas), policy="auto")
        return replace(reference, trim_last_canvas=True, reasons=reference.reasons + ["no device profile: diffusion"])
    return AutoPlanner(gen, canvas, profile, expected_steps).choose(max_tokens)
