"""Verified drafting rows: each keeps its own cache; the rows whose drafts take the same number of
steps (and, when sampling, the same temperature and draft length) draft together, one forward per
draft step, and are verified in one encoder pass, each keeping what it keeps (drafting.verify_rounds)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx

from .. import drafting
from ..drafting import DraftRow, DraftSettings, Round
from ..rules import rule_for, stopped
from . import Row


@dataclass(eq=False)
class _Verifying:
    """A verified row: its drafting state, and the tokens decided on entering (sent with the first round)."""

    row: Row
    draft: DraftRow
    first: list[int]


class VerifiedRows:
    """The verified drafting rows, grouped by draft shape at every round."""

    def __init__(self, engine):
        self.engine = engine
        self.rows: list[_Verifying] = []

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, row: Row, cache, logits: mx.array) -> None:
        """Decide the row's next token from ``logits`` (it goes out with the first round)."""
        job = row.job
        rule = rule_for(row, self.engine.tokenizer, self.engine.model.config.vocab_size)
        _, known = rule.follow(logits, [])
        self.rows.append(_Verifying(row, DraftRow(cache, known, rule, row.plan.settings, job.rng), rule.output[:]))

    def remove(self, uid: int) -> None:
        self.rows = [state for state in self.rows if state.row.uid != uid]

    def step(self) -> None:
        """A round of every row: rows with the same draft steps draft and are verified together, at the
        longest of their draft lengths (a longer draft than a row's plan costs the row only positions of
        a forward it shares; what it keeps is still verified). A row that samples drafts at its own
        length and temperature, so its draws are those it makes alone."""
        groups: dict[tuple, list[_Verifying]] = {}
        for state in list(self.rows):
            row = state.row
            if state.draft.known is None:  # the token decided on entering ended it
                self.rows.remove(state)
                self.engine.emit(row, state.first, 0, stopped(row.job, state.draft.rule, state.first), True)
                continue
            length = _draft_length(state)
            key = (row.plan.draft_steps, row.temperature, length if row.temperature else 0)
            groups.setdefault(key, []).append(state)
        for (steps, temperature, _), states in groups.items():
            for state in states:  # an auto row's plan may have changed since the last round
                state.draft.schedule = state.row.plan.settings
            settings = DraftSettings(max(map(_draft_length, states)), steps, temperature)
            rounds = drafting.verify_rounds(self.engine.model, [state.draft for state in states], settings)
            for state, done in zip(states, rounds):
                try:
                    if isinstance(done, Exception):
                        raise done
                    self._after_round(state, done)
                except Exception as e:  # this row's own part of the round: it alone ends
                    if state in self.rows:
                        self.rows.remove(state)
                    self.engine.fail(state.row, e)

    def _after_round(self, state: _Verifying, done: Round) -> None:
        row, draft, planner = state.row, state.draft, state.row.planner
        finished = done.known is None
        if planner is not None:
            planner.observe_round(
                row.plan, done, time.perf_counter() - row.started, row.job.ids, alone=self.engine.alone(row)
            )
        elif row.job.acceptance is not None and done.length > 1:
            row.job.acceptance.observe(row.plan.draft_steps, done.length, done.kept, done.rejected)
        # An auto row drafts afresh each round (no leftover start), as its plan may change between rounds.
        draft.known, draft.leftover = done.known, done.leftover if planner is None else []
        tokens, state.first = state.first + done.tokens, []
        row.remaining -= len(tokens)
        if self.engine.emit(row, tokens, done.forwards, finished and stopped(row.job, draft.rule, tokens), finished):
            self.rows.remove(state)
            return
        if planner is None:
            return
        self.engine.replan(row)
        row.started = time.perf_counter()
        if row.plan.mode != "verified":  # leaving verified drafting: the decided token goes into the cache
            self.rows.remove(state)
            logits = self.engine.model.next_token_logits(mx.array([[draft.known]]), draft.cache)
            self.engine.enter(row, draft.cache, logits)


def _draft_length(state: _Verifying) -> int:
    return max(1, min(state.row.plan.draft_length, state.draft.rule.room))
