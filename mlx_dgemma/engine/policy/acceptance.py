"""Verified drafting's acceptance: how many tokens a round of a given draft length and steps keeps,
estimated as drafting runs, and the draft shape with the most predicted tokens per second."""

from __future__ import annotations

from dataclasses import dataclass, field

from .profile import DRAFT_LENGTHS, Profile

DRAFT_STEPS = (1, 2)
# Per-draft-token acceptance of verified drafting on the demo tasks, from one and two draft steps
# (DEMO_ACCEPTANCE): a draft of 32 kept 6.3-12.2 tokens per round with one step, 10.2-23.8 with two.
PRIOR_ALPHA = {1: 0.85, 2: 0.9}


@dataclass
class Acceptance:
    """Running estimate of verified drafting's acceptance: with ``k`` draft steps, a draft token is
    kept with probability ``alpha(k)`` given that the ones before it were, so a round of L positions
    yields (1 − α^L)/(1 − α) tokens on average (the kept ones plus the encoder's next token). α is
    kept / (kept + rejections) over the rounds seen, started from a prior worth ``prior_weight``
    draft tokens; a round that ends at a stop id or at the draft's end counts its kept tokens only."""

    kept: dict[int, float] = field(default_factory=dict)
    rejected: dict[int, float] = field(default_factory=dict)
    prior_weight: float = 20.0
    prior: dict[int, float] = field(default_factory=lambda: dict(PRIOR_ALPHA))

    @classmethod
    def scaled(cls, factor: float, length: int = 32) -> "Acceptance":
        """The prior with ``factor`` times its tokens per round at drafts of ``length`` (0.5: half)."""
        base = cls()
        prior = {}
        for k in base.prior:
            target, low, high = factor * base.tokens_per_round(k, length), 0.0, 1.0 - 1e-9
            for _ in range(60):
                mid = (low + high) / 2
                low, high = (mid, high) if (1 - mid**length) / (1 - mid) < target else (low, mid)
            prior[k] = low
        return cls(prior=prior)

    def alpha(self, steps: int) -> float:
        prior = self.prior.get(steps, self.prior[max(self.prior)])
        kept = self.kept.get(steps, 0.0) + self.prior_weight * prior
        rejected = self.rejected.get(steps, 0.0) + self.prior_weight * (1 - prior)
        return kept / (kept + rejected)

    def tokens_per_round(self, steps: int, length: int) -> float:
        a = min(self.alpha(steps), 1 - 1e-9)
        return (1 - a**length) / (1 - a)

    def observe(self, steps: int, length: int, kept: int, rejected: bool, memory: float = 200.0) -> None:
        """A round kept ``kept`` draft tokens, then rejected one or not (a stop id, the draft's end);
        only the last ~``memory`` draft tokens count, so the estimate follows a change of task."""
        kept_total, rejected_total = self.kept.get(steps, 0.0) + kept, self.rejected.get(steps, 0.0) + rejected
        fade = min(1.0, memory / max(kept_total + rejected_total, 1e-9))
        self.kept[steps], self.rejected[steps] = kept_total * fade, rejected_total * fade

    def describe(self) -> str:
        seen = sum(self.kept.values()) + sum(self.rejected.values())
        alphas = ", ".join(f"{self.alpha(k):.2f} at {k} step(s)" for k in DRAFT_STEPS)
        return f"a draft token kept with probability {alphas}; {seen:.0f} draft tokens seen"


def best_draft(
    profile: Profile, acceptance: Acceptance, canvas: int, length: int | None = None, steps: int | None = None
) -> tuple[int, int, float]:
    """(draft length, draft steps, predicted tok/s) with the most predicted tokens per second among
    the candidate lengths up to the canvas and 1-2 steps (either may be fixed by the caller)."""
    lengths = [length] if length else [n for n in DRAFT_LENGTHS if n <= canvas] or [canvas]
    options = [
        (profile.verified_tok_s(n, k, acceptance.tokens_per_round(k, n)), n, k)
        for n in lengths
        for k in ([steps] if steps else DRAFT_STEPS)
    ]
    tok_s, n, k = max(options)
    return n, k, tok_s
