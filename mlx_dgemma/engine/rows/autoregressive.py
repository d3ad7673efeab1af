"""Autoregressive rows: one left-padded cache for all of them and one forward per token, every row in
it; each row is greedy, samples at its own temperature through its own draws, or is led by its
template or grammar (``rules.rule_for``). The next tokens are queued before the current ones are read,
so the host never waits on an idle device."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import mlx.core as mx

from ..filters import penalized, sampling_probs
from ..rules import rule_for, stopped
from . import Row

AR_BLOCK_MIN = 4  # tokens an auto row decodes autoregressively before it chooses again


@dataclass(eq=False)
class _Decoding:
    """An autoregressive row: its next token and what decides the ones after."""

    row: Row
    token: mx.array | None = None  # the next token, decided, not yet encoded, [1, 1]
    rule: object = None  # a template's or grammar's: it decides each token on the host
    block: int | None = None  # under auto: tokens left before it chooses again
    block_size: int = 0  # ... of a block of this many
    history: list[int] | None = None  # with penalties: the prompt and the tokens decided


def next_token(logits: mx.array, temperature: float, rng, filters: tuple = ()) -> mx.array:
    """The token [1, 1] after ``logits`` [1, V], lazily: greedy, or drawn through ``rng`` at ``temperature``
    through the ``filters`` (top_p, top_k, min_p: ``filters.sampling_probs``)."""
    if temperature:
        return rng.categorical(sampling_probs(logits, temperature, *filters))[:, None]
    return logits.argmax(-1, keepdims=True).astype(mx.int32)


class AutoregressiveRows:
    """The autoregressive rows and the one cache they share."""

    def __init__(self, engine):
        self.engine = engine
        self.rows: list[_Decoding] = []
        self.cache = None  # the rows' caches, left-padded into one, in the rows' order

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, row: Row, cache, logits: mx.array) -> None:
        """Decide the row's next token from ``logits`` and take its ``cache`` into the group's."""
        state = _Decoding(row)
        state.rule = rule_for(row, self.engine.tokenizer, self.engine.model.config.vocab_size)
        if state.rule is not None:
            token = state.rule.step(logits)
            if token is None or state.rule.done:  # nothing to feed: the template is whole
                self.engine.emit(row, state.rule.output, 0, True, True)
                return
            state.token = mx.array([[token]], dtype=mx.int32)
        else:
            self._new_block(state)
            state.token = self._pick(state, logits)
        if self.cache is None:
            self.cache = cache
        else:
            self.cache.extend(cache)
        self.rows.append(state)

    def remove(self, uid: int) -> None:
        keep = [i for i, state in enumerate(self.rows) if state.row.uid != uid]
        if len(keep) < len(self.rows):
            self._keep(keep)

    def step(self) -> None:
        """A token of every row in one forward. No token is drawn after a row's last one (a row's
        draws stay those it makes alone); a template's or grammar's row decides on the host."""
        if not self.rows:
            return
        tokens = mx.concatenate([state.token for state in self.rows])
        logits = self.engine.model.next_token_logits(tokens, self.cache)
        following, failed = [], {}
        for i, state in enumerate(self.rows):
            try:
                following.append(
                    self._pick(state, logits[i : i + 1]) if state.rule is None and not _ends(state) else None
                )
            except Exception as e:
                following.append(None)
                failed[i] = e
        mx.async_eval([f for f in following if f is not None])
        keep, leaving = [], []
        for i, (state, token) in enumerate(zip(self.rows, tokens[:, 0].tolist())):
            try:
                if i in failed:
                    raise failed[i]
                went = self._ruled_token(state, logits[i]) if state.rule is not None else self._free_token(state, token)
                if went == "on":
                    state.token = following[i] if state.rule is None else state.token
                elif went == "switch":  # an auto row's block is done: another block stays in the group
                    row = state.row
                    self.engine.replan(row)
                    if row.plan.mode == "ar":
                        row.started = time.perf_counter()
                        self._new_block(state)
                        state.token = self._pick(state, logits[i : i + 1])
                        went = "on"
                    else:
                        leaving.append((row, self._take(i), logits[i : i + 1]))
            except Exception as e:  # this row's own part of the step: it alone ends
                self.engine.fail(state.row, e)
                continue
            if went == "on":
                keep.append(i)
        self._keep(keep)
        for row, cache, row_logits in leaving:
            self.engine.enter(row, cache, row_logits)

    def _take(self, i: int):
        """Row ``i``'s own cache, unpadded (the group's own when it is the only row)."""
        return self.cache if len(self.rows) == 1 else self.cache.row(i)

    def _keep(self, keep: list[int]) -> None:
        self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            self.cache = None
        elif len(keep) < self.cache.batch_size:
            self.cache.filter(keep)

    def _new_block(self, state: _Decoding) -> None:
        row = state.row
        state.block_size = self.engine.model.config.canvas_length
        if row.planner is not None:  # a block as long as the answer is expected still to be
            expected = math.ceil(row.planner.expected_tokens(row.emitted, row.job.ids))
            # (a block run to time AR, not as the best plan: the shortest, since it is paid for at AR's pace)
            expected = AR_BLOCK_MIN if row.plan.exploring else expected
            state.block_size = min(state.block_size, row.remaining, max(AR_BLOCK_MIN, expected))
        state.block = state.block_size

    def _free_token(self, state: _Decoding, token: int) -> str:
        """A free row's token: "on", "done", or "switch" (an auto row's block is done: it chooses again)."""
        row = state.row
        row.remaining -= 1
        state.block -= 1
        stop = token in row.job.stop_ids
        last = stop or row.remaining <= 0
        if row.planner is not None and (last or state.block == 0):
            row.planner.observe_ar(
                row.plan,
                state.block_size - state.block,
                time.perf_counter() - row.started,
                row.job.ids,
                alone=self.engine.alone(row),
            )
        if self.engine.emit(row, [token], 1, stop, last, state.block == 0):
            return "done"
        if state.block == 0:
            if row.planner is not None:
                return "switch"
            state.block = state.block_size
        return "on"

    def _ruled_token(self, state: _Decoding, logits: mx.array) -> str:
        """A template's or grammar's row's next decision after ``logits`` [V] (the output it adds: the
        token, or a closed hole's padding too): "on" or "done"."""
        row, rule = state.row, state.rule
        token = rule.step(logits)
        done = token is None or rule.done
        stop = done and stopped(row.job, rule, rule.output)
        if self.engine.emit(row, rule.output[row.emitted :], 1, stop, done, False) or done:
            return "done"
        state.token = mx.array([[token]], dtype=mx.int32)
        return "on"

    def _pick(self, state: _Decoding, logits: mx.array) -> mx.array:
        """The row's next token, decided (lazily, unless penalties need it on the host for the next one)."""
        row = state.row
        settings = row.plan.settings
        if not settings.penalizing:
            return next_token(logits, row.temperature, row.job.rng, settings.filters)
        if state.history is None:
            state.history = list(row.job.ids)
        token = next_token(
            penalized(logits, state.history, *settings.penalties), row.temperature, row.job.rng, settings.filters
        )
        state.history.append(token.item())
        return token


def _ends(state: _Decoding) -> bool:
    """Whether the row's next token is its last (no token is drawn after it) or its auto block's."""
    return state.row.remaining == 1 or state.row.planner is not None and state.block == 1
