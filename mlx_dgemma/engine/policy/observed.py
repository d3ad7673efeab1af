"""The live device profile: the times of the forwards auto runs (its canvases, blocks and rounds:
free measurements, at the load the machine has now) blended into the measured profile. The cache
on disk takes the times that are faster than its own (another process's load slows a forward only
while it lasts), and the kinds of forward observed."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from .profile import Profile, settled

# Observations kept per point (their lower quartile counts: ``settled``). Beside a busy core a burst
# 10x slower lasted 9 canvases, and a point that moved with it priced its plan out against the plans
# not run meanwhile, though the burst slowed them too. After CONFIRM observations a point faster than
# the cache's by DISAGREE or more is written to it; a kind of forward observed (within DISAGREE of
# the cache, or CONFIRM times) is marked observed in it.
KEPT = 32
CONFIRM = 3
DISAGREE = 2.0


class LiveProfile:
    """``base`` (the profile read or measured) times the ratio observed at each point: the seconds a
    forward took over those ``base`` predicts for it at the same prefix, the lower quartile of the
    last ``KEPT`` (``settled``: a burst of another process's work does not move it). Until a point
    has ``CONFIRM`` observations, ``base``'s own time counts as one of them: one forward faster than
    it moves the point at once (a cached time too slow is found out by one canvas or block), a slower
    one only once ``CONFIRM`` agree (on a shared core one canvas in a few runs 2-5x slow, and a plan
    predicted from it alone would not be run again to find that out). A point not
    observed takes the ratio of the nearest observed length of its kind, else of the other ("step"
    and "verify" passes share theirs until each kind is observed: the same layers over several
    positions; "ar" keeps its own; a round's overheads are not a canvas's, and each untried draft
    length would otherwise look as cheap as a canvas). A round's draft steps cost what canvases say
    a step costs, once one is observed, and its verifying pass the rest. So a load that slows every
    forward moves the whole profile. The result is fitted to a shape the hardware can have
    (``Profile.fitted``).

    ``store`` writes a profile to the cache, which holds ``cached``: ``base`` with each point observed
    ``CONFIRM`` times at its settled time where that is faster by ``DISAGREE`` or more (a profile
    measured under load, or before the machine got faster), never slower (a busy hour would otherwise
    price diffusion out of every later process, quiet or not: the next process finds a slower time in
    ``CONFIRM`` forwards), and the kinds of forward observed, which a later process does not probe."""

    def __init__(self, base: Profile, store: Callable[[Profile], None] | None = None):
        self.base, self.store, self.profile = base, store, base
        self.cached = base  # what the cache holds
        self.measured = base  # the profile it started from, for reports
        self.ratios: dict[tuple[str, int], deque[float]] = {}  # (kind, length) -> observed / base
        self.seen: dict[tuple[str, int], deque[float]] = {}  # the same as seconds at base's prefix, for reports
        self.counts: dict[tuple[str, int], int] = {}
        self.draft_steps: dict[int, int] = {}  # per draft length, the draft steps of its latest round

    def observed_kinds(self) -> set[str]:
        return set(self.cached.observed) | {kind for kind, _ in self.ratios}

    def observe_canvas(
        self, positions: int, steps: int, prefix: int, seconds: float, encoded: int | None = None
    ) -> None:
        """A canvas took ``steps`` denoising steps of ``positions`` computed positions and its commit
        encode (a pass like a verifying one over ``encoded`` positions: by default ``positions``; 0:
        the answer ended with the canvas, nothing was encoded) in ``seconds``, after ``prefix`` tokens."""
        p = self.base.at_prefix(prefix)
        encode = p.verify_s(positions if encoded is None else encoded) if encoded != 0 else 0.0
        self._add("step", positions, seconds / (steps * p.step_s(positions) + encode))

    def observe_ar(self, tokens: int, prefix: int, seconds: float) -> None:
        """``tokens`` autoregressive tokens took ``seconds`` after ``prefix`` tokens."""
        self._add("ar", 1, seconds / tokens / self.base.at_prefix(prefix).ar_token_s)

    def observe_round(self, length: int, steps: int, prefix: int, seconds: float) -> None:
        """A verified round (``steps`` draft steps of ``length`` positions and the verifying pass)."""
        p = self.base.at_prefix(prefix)
        self.draft_steps[length] = steps
        self._add("verify", length, seconds / (steps * p.step_s(length) + p.verify_s(length)))

    def _add(self, kind: str, length: int, ratio: float) -> None:
        if not 0 < ratio < math.inf:
            return
        key = (kind, length)
        self.ratios.setdefault(key, deque(maxlen=KEPT)).append(ratio)
        self.seen.setdefault(key, deque(maxlen=KEPT)).append(ratio * _point(self.base, key))
        self.counts[key] = self.counts.get(key, 0) + 1
        self.profile = self._blended()
        if self.store is not None:
            self._keep(key)

    def _keep(self, key: tuple[str, int]) -> None:
        """Write to the cache what an observation at ``key`` confirms: the live profile where it is
        faster than the cache's (once a point observed ``CONFIRM`` times is faster by ``DISAGREE``), and
        the kind observed (so that the next process does not run it to check)."""
        values, cached = self.ratios[key], self.cached
        confirmed = {k: settled(v) for k, v in self.ratios.items() if len(v) >= CONFIRM}
        faster = any(_point(self.base, k) * r * DISAGREE <= _point(cached, k) for k, r in confirmed.items())
        agrees = 1 / DISAGREE < settled(values) * _point(self.base, key) / _point(cached, key) < DISAGREE
        if not faster and (key[0] in cached.observed or not (agrees or len(values) >= CONFIRM)):
            return
        observed = sorted({*cached.observed, key[0], *(kind for kind, _ in confirmed)})
        if faster:
            live = self.profile
            # a round's ratio on its verifying pass (what its draft steps leave may be a burst's)
            rounds = self._scaled(self._ratios(), "verify", self.base.verify_s_by_length)
            cached = replace(
                cached,
                source="observed",
                step_s_by_canvas={n: min(s, live.step_s(n)) for n, s in cached.step_s_by_canvas.items()},
                verify_s_by_length={n: min(s, rounds.get(n, s)) for n, s in cached.verify_s_by_length.items()},
                ar_token_s=min(cached.ar_token_s, live.ar_token_s),
            ).fitted()
        self.cached = replace(cached, observed=observed)
        self.store(self.cached)

    def _ratios(self) -> dict[tuple[str, int], float]:
        # until CONFIRM observations, the profile's own time stands as one of them
        return {
            key: settled([*values, 1.0] if len(values) < CONFIRM else values) for key, values in self.ratios.items()
        }

    @staticmethod
    def _scaled(ratio: dict[tuple[str, int], float], kind: str, points: dict[int, float]) -> dict[int, float]:
        """``points`` of ``kind`` times their ratio; a point not observed takes the nearest observed of
        its kind (a round's overheads are not a canvas's), else the nearest forward of either."""
        own = [(n, r) for (k, n), r in ratio.items() if k == kind]
        near = own or [(n, r) for (k, n), r in ratio.items() if k != "ar"]
        out = {}
        for n, s in points.items():
            if (kind, n) in ratio:
                out[n] = s * ratio[kind, n]
            elif near:
                out[n] = s * min(near, key=lambda o: (abs(math.log2(o[0] / n)), o[0]))[1]
            else:
                out[n] = s
        return out

    def _blended(self) -> Profile:
        ratio = self._ratios()
        steps = self._scaled(ratio, "step", self.base.step_s_by_canvas)
        if any(kind == "step" for kind, _ in ratio):
            # A round's draft steps cost what canvases say a step costs now, and its verifying pass
            # the rest of the round's settled time, so that the round is predicted as it was observed
            # (before any canvas, one ratio for both: a round cannot tell them apart).
            at_canvases = replace(self.base, step_s_by_canvas=steps)
            for (kind, n), r in list(ratio.items()):
                if kind == "verify":
                    drafting, verify = self.draft_steps[n] * at_canvases.step_s(n), self.base.verify_s(n)
                    round_s = r * (self.draft_steps[n] * self.base.step_s(n) + verify)
                    ratio[kind, n] = max(round_s - drafting, round_s / 10) / verify
        return replace(
            self.base,
            source=f"{self.base.source}, with observed forwards" if ratio else self.base.source,
            step_s_by_canvas=steps,
            verify_s_by_length=self._scaled(ratio, "verify", self.base.verify_s_by_length),
            ar_token_s=self.base.ar_token_s * ratio.get(("ar", 1), 1.0),
        ).fitted()

    def report(self) -> list[tuple[str, int, float, float | None, int]]:
        """(kind, length, seconds in the profile it started from, seconds observed (the lower quartile
        of the last few, at that profile's prefix; a verifying pass: what its rounds leave after their
        draft steps) or None, observations) per point and per length observed, for
        ``python -m mlx_dgemma.bench``."""
        m = self.measured
        lengths = {("step", n) for n in m.step_s_by_canvas} | {("verify", n) for n in m.verify_s_by_length}
        rows = []
        for kind, n in sorted(lengths | set(self.seen) | {("ar", 1)}):
            start = m.ar_token_s if kind == "ar" else m.step_s(n) if kind == "step" else m.verify_s(n)
            seen = self.seen.get((kind, n))
            observed = (self.profile.verify_s(n) if kind == "verify" else settled(seen)) if seen else None
            rows.append((kind, n, start, observed, self.counts.get((kind, n), 0)))
        return rows


def _point(profile: Profile, key: tuple[str, int]) -> float:
    """The seconds ``profile`` gives the forward at ``key`` ((kind, length), as ``LiveProfile`` keeps
    them; a round's ratio goes to its verifying pass here)."""
    kind, n = key
    if kind == "ar":
        return profile.ar_token_s
    return profile.step_s(n) if kind == "step" else profile.verify_s(n)
