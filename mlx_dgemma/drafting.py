"""Verified drafting: the decoder drafts, the encoder verifies (speculative decoding in one checkpoint).

The encoder is a causal LM and must run over every committed token anyway; the decoder proposes
many tokens at once. One round, with the next token already known (the encoder's prediction):

1. a canvas of ``length`` positions, position 0 clamped to the known token, is denoised in
   ``steps`` steps (argmax drafts, self-conditioning from the second step on);
2. one encoder forward over the draft (causal, appending to the cache) predicts the token after
   each draft position;
3. the longest prefix on which the draft equals the predictions is kept, the prediction at the first
   disagreement becomes the next known token, and the cache is trimmed back to what was kept.

Greedy (temperature 0) the output is autoregressive greedy decoding's, token for token. Sampling
(temperature > 0) uses speculative rejection sampling: the draft's last step draws each position
from its tempered, filtered distribution q, a draft token is accepted with probability min(1, p/q)
(p: the encoder's tempered distribution through the same filters, filters.sampling_probs) and on
rejection the next token is drawn from max(0, p − q) normalised, so the output is distributed
exactly as autoregressive sampling at that temperature with those filters.

What "the next token" is comes from a rule: ``GreedyRule`` and ``SampledRule`` decode freely up to
a stop id or a token budget; ``TemplateRule`` forces a template's text and decodes its holes (the
autoregressive template rows of the engine, batch.py, run the same rule one token at a time).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import mlx.core as mx
import numpy as np

from .cache import CanvasView
from .filters import sampling_probs
from .sampler import Random, SamplerSettings, tempered_distribution
from .template import Clamp


@dataclass(frozen=True)
class DraftSettings:
    """One round's draft: ``length`` canvas positions (the known token included), ``steps`` denoising
    steps; ``temperature`` 0 is greedy, otherwise the sampling temperature of the output."""

    length: int
    steps: int
    temperature: float = 0.0
    reuse: bool = True  # seed a draft with the previous draft's tokens after the rejected one

    def check(self, canvas_length: int) -> None:
        if not isinstance(self.length, int) or not 1 <= self.length <= canvas_length:
            raise ValueError(f"draft length must be an integer from 1 to the model's canvas length {canvas_length}, "
                             f"got {self.length!r}")
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"draft steps must be a positive integer, got {self.steps!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


class GreedyRule:
    """Greedy decoding up to a stop id or ``max_tokens``."""

    def __init__(self, stop_ids, max_tokens: int):
        self.stop_ids, self.max_tokens = set(stop_ids), max_tokens
        self.output: list[int] = []
        self.done = False

    @property
    def room(self) -> int:
        """Most tokens still to come."""
        return self.max_tokens - len(self.output)

    def known(self, n: int) -> list[int]:
        """Tokens that will follow the last decision whatever the model predicts (none when free)."""
        return []

    def _emit(self, token: int) -> None:
        self.output.append(token)
        self.done = token in self.stop_ids or len(self.output) >= self.max_tokens

    def follow(self, logits: mx.array, proposed: list[int], q: mx.array | None = None) -> tuple[int, int | None]:
        """Decide along ``logits`` [n, V] (row j: the prediction after the j-th fed token) while the
        decisions equal ``proposed`` [n − 1]. Returns (proposals accepted, the next known token or
        None when decoding is done: then a stop id that was a proposal counts as accepted)."""
        for j, token in enumerate(np.array(logits.argmax(-1)).tolist()):
            self._emit(token)
            agrees = j < len(proposed) and token == proposed[j]
            if self.done:
                return j + agrees, None
            if not agrees:
                return j, token
        raise AssertionError("more proposals than rows")


class SampledRule(GreedyRule):
    """Sampling at ``temperature`` through the ``filters`` (top_p, top_k, min_p:
    ``filters.sampling_probs``); with a draft, speculative rejection sampling against the draft's
    distribution ``q`` [n − 1, V] of the proposed tokens, exact for the filtered target."""

    def __init__(self, stop_ids, max_tokens: int, temperature: float, rng: Random, filters: tuple = ()):
        super().__init__(stop_ids, max_tokens)
        self.temperature, self.rng, self.filters = temperature, rng, tuple(filters)

    @staticmethod
    def acceptance(p: mx.array, q: mx.array) -> mx.array:
        """Probability of keeping a draft token drawn from q where the target gives it p."""
        return mx.minimum(1.0, p / q)

    @staticmethod
    def residual(p: mx.array, q: mx.array) -> mx.array:
        """What to draw from after a rejection: max(0, p − q) normalised (p where that is all zero,
        which happens only where p ≤ q everywhere, i.e. p = q, and then nothing is rejected)."""
        residual = mx.maximum(p - q, 0.0)
        mass = residual.sum(-1, keepdims=True)
        return mx.where(mass > 1e-12, residual / mx.maximum(mass, 1e-30), p)

    def follow(self, logits, proposed, q=None):
        p = sampling_probs(logits, self.temperature, *self.filters)
        n = len(proposed)
        accept = resampled = None
        if n:
            rows, idx = mx.arange(n), mx.array(proposed)
            keep = self.acceptance(p[rows, idx], q[rows, idx])
            # A Bernoulli draw is a categorical over (reject, accept): every draw goes through ``rng``.
            accept = self.rng.categorical(mx.stack([1 - keep, keep], axis=-1))
            resampled = self.rng.categorical(self.residual(p[:n], q))
        bonus = self.rng.categorical(p[n:n + 1])
        mx.eval(accept, resampled, bonus)
        for j in range(n):
            if accept[j].item():
                self._emit(proposed[j])
                if self.done:
                    return j + 1, None
                continue
            self._emit(resampled[j].item())
            return j, None if self.done else self.output[-1]
        self._emit(bonus[0].item())
        return n, None if self.done else self.output[-1]


class TemplateRule:
    """A template decoded autoregressively: literal tokens forced, each hole decoded greedily among the
    tokens its class allows until the model predicts the text that follows it (the rest of the hole is
    padding, as in a canvas, and is not fed to the model). ``output`` is aligned with the template."""

    def __init__(self, template, tokenizer, vocab: int, end_of_turn: int | None):
        from .template import token_classes

        self.pad = tokenizer.pad_token_id
        self.classes = token_classes(tokenizer, vocab)
        self.tokens = list(template.tokens) + ([end_of_turn] if end_of_turn is not None else [])
        self.holes = dict(template.holes)
        self.output: list[int] = []
        self.position = 0  # next template position to decide
        self.chosen: list[int] = []  # the open hole's tokens so far

    @property
    def done(self) -> bool:
        return self.position >= len(self.tokens)

    @property
    def room(self) -> int:
        return len(self.tokens) - self.position

    def known(self, n: int) -> list[int]:
        out, i = [], self.position
        while i < len(self.tokens) and i not in self.holes and len(out) < n:
            out.append(self.tokens[i])
            i += 1
        return out

    def step(self, logits: mx.array) -> int | None:
        """The next token to feed, given the logits after the last fed one (None: the template is done)."""
        from .template import FREE

        scores = None
        while not self.done:
            if self.position not in self.holes:
                token = self.tokens[self.position]
                self.output.append(token)
                self.position += 1
                return token
            hole = self.holes[self.position]
            if scores is None:
                scores = np.array(logits.reshape(-1).astype(mx.float32))
            j = len(self.chosen)
            end = self.position + hole.size
            following = self.tokens[end] if end < len(self.tokens) else None
            if hole.kind == "choice":
                allowed = np.zeros_like(scores, dtype=bool)
                live = [c for c in hole.choices if c[:j] == self.chosen]
                allowed[[c[j] for c in live if len(c) > j]] = True
                finished = any(len(c) == j for c in live)
            else:
                allowed = self.classes[hole.kind]
                finished = j >= hole.required and following not in (None, FREE) and int(scores.argmax()) == following
            if finished or not allowed.any():
                self._close(hole.size)
                continue
            token = int(np.where(allowed, scores, -np.inf).argmax())
            self.chosen.append(token)
            if len(self.chosen) == hole.size:
                self._close(hole.size)
            return token
        return None

    def _close(self, size: int) -> None:
        self.output += self.chosen + [self.pad] * (size - len(self.chosen))
        self.position += size
        self.chosen = []

    def follow(self, logits, proposed, q=None):
        for j in range(logits.shape[0]):
            token = self.step(logits[j])
            agrees = j < len(proposed) and token == proposed[j]
            if token is None or self.done:
                return j + agrees, None
            if not agrees:
                return j, token
        raise AssertionError("more proposals than rows")


@dataclass
class DraftRow:
    """One row of verified drafting: its own cache, the next token (decided, not yet in the cache; None
    when decoding is done), the rule that decides its tokens, the sampler settings whose temperatures
    self-condition its drafts, its random draws, and the previous draft's tail after its first
    rejected token (the next draft starts from it)."""

    cache: object
    known: int | None
    rule: object
    schedule: SamplerSettings
    rng: Random
    leftover: list[int] = field(default_factory=list)

    def fixed(self, length: int) -> list[int]:
        """The tokens a draft of ``length`` starts with, clamped: the known one, then any the rule forces."""
        return [self.known] + self.rule.known(length - 1)


def draft(model, row: DraftRow, settings: DraftSettings) -> tuple[mx.array, mx.array | None]:
    """A draft of ``settings.length`` tokens [length] (lazy: the verifying pass is queued behind it
    without a wait) starting with the row's fixed tokens (clamped), denoised after its cache (only
    read) in ``settings.steps`` steps, and, when sampling, the distribution [length, V] its last step
    drew each position from. The positions after the fixed ones start from the row's leftover
    (not clamped) when ``settings.reuse``, from noise otherwise."""
    drafted, qs = draft_rows(model, row.cache.canvas_view(settings.length), [row], settings)
    return drafted[0], qs[0]


def draft_rows(model, view, rows: list[DraftRow], settings: DraftSettings) -> tuple[mx.array, list[mx.array | None]]:
    """``draft`` for ``rows`` at once through ``view`` (their canvas views of ``settings.length``
    positions, stacked): each row with its own fixed tokens, schedule, random draws and start;
    drafts [B, length]."""
    vocab, length = model.config.vocab_size, settings.length
    fixed = np.zeros((len(rows), length), dtype=bool)
    tokens = np.zeros((len(rows), length), dtype=np.int32)
    canvases = []
    for i, row in enumerate(rows):
        known = row.fixed(length)
        fixed[i, :len(known)] = True
        tokens[i, :len(known)] = known
        canvas = row.rng.canvas((1, length), vocab)
        seeded = list(row.leftover if settings.reuse else ())[:length - len(known)]
        if seeded:
            canvas[0, len(known):len(known) + len(seeded)] = mx.array(seeded, dtype=canvas.dtype)
        canvases.append(canvas)
    clamp = Clamp(mx.array(fixed), mx.array(tokens))
    canvas = clamp.apply(canvases[0] if len(canvases) == 1 else mx.concatenate(canvases))
    self_conditioning = self_conditioning_probs = None
    schedules = [replace(row.schedule, steps=settings.steps) for row in rows]  # the temperatures over the draft's steps
    qs = [None] * len(rows)
    for step in range(1, settings.steps + 1):
        logits = model.denoise(canvas, view, self_conditioning, self_conditioning_probs)
        if step == settings.steps:
            if settings.temperature > 0:
                qs = [sampling_probs(logits[i], settings.temperature, *schedules[i].filters) for i in range(len(rows))]
                canvas = clamp.apply(mx.concatenate([row.rng.categorical(q)[None] for q, row in zip(qs, rows)]))
            else:
                canvas = clamp.apply(logits.argmax(-1).astype(mx.int32))
            break
        temperature = (schedules[0].temperature(step - 1) if len(rows) == 1
                       else mx.stack([s.temperature(step - 1) for s in schedules])[:, None, None])
        self_conditioning, self_conditioning_probs, _, argmax = tempered_distribution(logits, temperature)
        canvas = clamp.apply(argmax)
    return canvas, qs


@dataclass
class Round:
    tokens: list[int]  # what the round added to the rule's output
    known: int | None  # the next token (decided, not yet encoded); None when decoding is done
    length: int  # draft positions, the known token included
    kept: int  # draft tokens kept after the known one
    forwards: int  # draft steps + the verifying pass
    leftover: list[int]  # the draft's tokens after the first rejected one (a start for the next draft)

    @property
    def rejected(self) -> bool:
        """Whether a draft token was rejected (not merely cut short by the answer's end)."""
        return self.known is not None and self.kept < self.length - 1


def verify_rounds(model, rows: list[DraftRow], settings: DraftSettings) -> list[Round | Exception]:
    """One round for each row after its known token: draft (from its leftover), verify, keep, trim.
    The drafts have one length (``settings.length``): one forward per draft step and one verifying
    pass for all the rows; each row keeps what it keeps. The rows' caches and rules move on; their
    known tokens and leftovers are the rounds' to set. A row whose rule raises gets its exception in
    place of its round."""
    length = settings.length
    befores = [len(row.rule.output) for row in rows]
    q = [None] * len(rows)
    if length == 1:  # nothing to draft: an autoregressive step
        drafted, forwards, view = mx.array([[row.known] for row in rows], dtype=mx.int32), 1, None
    else:
        view = CanvasView.stack([row.cache.canvas_view(length) for row in rows])
        drafted, q = draft_rows(model, view, rows, settings)
        forwards = settings.steps + 1
    if len(rows) == 1:
        logits = model.head(model.encode(drafted, rows[0].cache, return_hidden=True))
    else:  # the drafts go through the rows' stacked views, then into each row's cache
        view = view or CanvasView.stack([row.cache.canvas_view(length) for row in rows])
        logits = model.head(model.encode(drafted, view, return_hidden=True))
        view.append_canvas([row.cache for row in rows])
    mx.eval(drafted, logits)  # the round's one wait: the drafts and their verification together
    rounds = []
    for i, (row, before) in enumerate(zip(rows, befores)):
        tokens = drafted[i].tolist()
        try:
            kept, next_known = row.rule.follow(logits[i], tokens[1:], None if q[i] is None else q[i][1:])
        except Exception as e:  # this row's rule (its grammar) failed: the others keep their rounds
            rounds.append(e)
            continue
        row.cache.trim(length - 1 - kept)
        rounds.append(Round(row.rule.output[before:], next_known, length, kept, forwards, tokens[kept + 2:]))
    return rounds
