"""Plans: how to generate (the mode, the sampler settings, the draft shape, the reasons) and the plan
each fixed policy (reference, fast, ar, verified) gives; auto's come from auto.py."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from ...errors import OptionError
from ...model.config import GenerationConfig
from ..sampler import SamplerSettings
from .acceptance import Acceptance, best_draft
from .profile import Profile

POLICIES = ("reference", "auto", "fast", "ar", "verified")


@dataclass
class Plan:
    """How to generate: the mode, the sampler settings every canvas and draft runs with, and the last
    canvas length, with reasons. The settings are the policy's, or with the caller's in their place
    (``overridden``); nothing else holds a copy of them."""

    policy: str
    mode: str  # "diffusion" | "ar" | "verified"
    settings: SamplerSettings
    trim_last_canvas: bool = False
    reasons: list[str] = field(default_factory=list)
    draft_length: int = 0  # verified drafting (drafting.py): canvas positions per draft, the known token included
    draft_steps: int = 0  # verified drafting: denoising steps per draft
    predicted: tuple[str, float] | None = None  # auto's choice and its tok/s predicted (before its pace)
    context: int = 0  # auto: the prompt and answer tokens before the canvas, block or round it was chosen for
    # auto: every plan's predicted tok/s and what it rests on (the costs), best first, and why the
    # chosen one ran (the best, or a probe or a retry)
    predictions: tuple[tuple[str, float, str], ...] = ()
    why: str = ""
    exploring: bool = False  # auto: run to measure it (a probe, a trial or a retry), not as the best

    def explain(self) -> str:
        head = f"plan ({self.policy}): {self.mode}"
        s = self.settings
        if self.mode == "diffusion":
            head += f", ≤{s.steps} steps/canvas, entropy bound {s.entropy_bound:g}, t {s.t_min:g}–{s.t_max:g}"
            if s.freeze_after:
                head += f", positions settled for {s.freeze_after} step(s) frozen"
            head += ", last canvas trimmed to the tokens wanted" if self.trim_last_canvas else ", full canvases"
        if self.mode == "verified":
            head += f", drafts of {self.draft_length} tokens in {self.draft_steps} step(s), verified by the encoder"
        return "\n".join([head] + [f"  - {r}" for r in self.reasons])

    def choice(self) -> str:
        """One line: the kind auto ran this canvas, block or round in, and why (the predictions)."""
        if self.predicted is None:
            return f"{self.policy}: {self.mode}"
        name = self.predicted[0]
        tok_s, costs = next((t, w) for n, t, w in self.predictions if n == name)
        others = ", ".join(f"{n} {t:.1f}" for n, t, _ in self.predictions if n != name)
        return f"auto ran {name}{self.why}: {tok_s:.1f} tok/s predicted ({costs}); {others}"

    def overridden(self, overrides: dict) -> Plan:
        """The plan with the caller's sampler settings (``SamplerSettings`` field -> value, every one
        applied) in place of the policy's, naming those that differ from the policy's choice."""
        settings = replace(self.settings, **overrides)
        changed = [f.name for f in fields(settings) if getattr(settings, f.name) != getattr(self.settings, f.name)]
        if not changed:
            return self
        given = ", ".join(f"{name.replace('_', ' ')} {getattr(settings, name):g}" for name in changed)
        return replace(self, settings=settings, reasons=self.reasons + [f"set by the caller: {given}"])

    def last_canvas_length(self, remaining: int, canvas: int) -> int:
        """Length of a canvas when only ``remaining`` tokens are still wanted: whole canvases unless
        trimming, else rounded up to a multiple of 16 (of canvas/4 for small canvases)."""
        if not self.trim_last_canvas or remaining >= canvas:
            return canvas
        multiple = max(1, min(16, canvas // 4))
        return min(canvas, -(-remaining // multiple) * multiple)


@dataclass(frozen=True)
class DraftRequest:
    """What a verified request asks of its drafts: a length and steps (None: the profile's best), and
    ``acceptance``, verified drafting's running estimate, to choose them by."""

    length: int | None = None
    steps: int | None = None
    acceptance: Acceptance | None = None


FREEZE_AFTER = 1  # the fast policy's active-set compaction: benchmarks/demo_speed.py measures the choice


def fixed_plan(
    policy: str,
    gen: GenerationConfig,
    canvas: int,
    profile: Profile | None = None,
    draft: DraftRequest = DraftRequest(),
) -> Plan:
    """The plan of a policy that does not re-plan as it goes (reference, fast, ar, verified), from the
    generation config and, for verified drafting, the device profile and ``draft``. Any policy's plan, auto's included, is ``auto.make_plan``'s."""
    reference = Plan(
        policy,
        "diffusion",
        SamplerSettings.from_generation_config(gen),
        reasons=[
            f"the checkpoint's generation config: {gen.max_denoising_steps} steps, bound {gen.entropy_bound:g}, "
            f"t {gen.t_min:g}–{gen.t_max:g}, whole canvases"
        ],
    )
    if policy == "reference":
        return reference
    if policy == "ar":
        return replace(reference, mode="ar", reasons=["autoregressive decoding requested (the encoder as a causal LM)"])
    if policy == "verified":
        return verified_plan(reference, canvas, profile, draft)
    if policy == "fast":
        return replace(
            reference,
            settings=replace(reference.settings, freeze_after=FREEZE_AFTER, stability_threshold=0),
            trim_last_canvas=True,
            reasons=[
                f"positions accepted with the same token {FREEZE_AFTER} step(s) running are frozen (K/V kept) "
                "and no longer recomputed: a step costs the share of the canvas still moving",
                "a canvas may stop once confident (stability threshold 0): no extra step to confirm it",
                "the last canvas is cut to the tokens still wanted (a step costs ~ canvas length when compute-bound)",
                "measured on the demo tasks: benchmarks/demo_speed.py",
            ],
        )
    raise OptionError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")


def verified_plan(reference: Plan, canvas: int, profile: Profile | None, draft: DraftRequest) -> Plan:
    """Verified drafting with the draft length and steps ``draft`` gives, the rest chosen for ``profile``."""
    length, steps = draft.length, draft.steps
    reasons = [
        "verified drafting: the decoder drafts, the encoder verifies and encodes the draft in one "
        "forward; the output is autoregressive decoding's"
    ]
    if length is None or steps is None:
        if profile is None:
            best_length, best_steps = min(canvas, 32), 2
            reasons.append(f"no device profile: drafts of {best_length} in {best_steps} steps")
        else:
            acceptance = draft.acceptance or Acceptance()
            best_length, best_steps, tok_s = best_draft(profile, acceptance, canvas, length, steps)
            reasons.append(
                f"{profile.device} ({profile.source}): {best_length} positions in {best_steps} step(s) "
                f"predicted fastest, {acceptance.tokens_per_round(best_steps, best_length):.1f} tokens "
                f"per round at {tok_s:.1f} tok/s ({acceptance.describe()})"
            )
        length = best_length if length is None else length
        steps = best_steps if steps is None else steps
    return replace(reference, mode="verified", draft_length=length, draft_steps=steps, reasons=reasons)
