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

What "the next token" is comes from a decoding rule (rules.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import mlx.core as mx
import numpy as np

from ..errors import OptionError
from ..model.cache import CanvasView
from ..structured.template import Clamp
from .filters import sampling_probs
from .sampler import Random, SamplerSettings, tempered_distribution


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
            raise OptionError(
                f"draft length must be an integer from 1 to the model's canvas length {canvas_length}, "
                f"got {self.length!r}"
            )
        if not isinstance(self.steps, int) or self.steps < 1:
            raise OptionError(f"draft steps must be a positive integer, got {self.steps!r}")
        if not self.temperature >= 0:
            raise OptionError(f"temperature must be >= 0, got {self.temperature}")


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
        fixed[i, : len(known)] = True
        tokens[i, : len(known)] = known
        canvas = row.rng.canvas((1, length), vocab)
        seeded = list(row.leftover if settings.reuse else ())[: length - len(known)]
        if seeded:
            canvas[0, len(known) : len(known) + len(seeded)] = mx.array(seeded, dtype=canvas.dtype)
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
        temperature = (
            schedules[0].temperature(step - 1)
            if len(rows) == 1
            else mx.stack([s.temperature(step - 1) for s in schedules])[:, None, None]
        )
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
        rounds.append(Round(row.rule.output[before:], next_known, length, kept, forwards, tokens[kept + 2 :]))
    return rounds
