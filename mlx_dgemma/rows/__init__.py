"""The engine's rows by kind (batch.py drives them): ``diffusion`` (canvases, lanes of rows denoised
together), ``autoregressive`` (one left-padded cache, a token per row per forward) and ``verified``
(drafts verified by the encoder, rows of one draft shape in one round). Each kind owns its rows' state
and has ``add(row, cache, logits)`` (start a row from its own cache and the next-token logits after
it), ``step()`` (one forward's worth for every row), ``remove(uid)`` and ``len``. A kind is made with
the engine and calls back into it: ``emit`` hands out what a row committed, ``replan`` asks an auto
row's planner for its next plan and ``enter`` starts a row in its plan's kind.

``Row`` is what every kind knows of a request; ``layout_rule`` and ``stopped`` are the template's and
grammar's part, shared by the autoregressive and verified kinds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..drafting import TemplateRule
from ..grammar_rule import GrammarRule
from ..policy import Plan
from ..request import PreparedRequest
from ..sampler import Draft


@dataclass(eq=False)
class Row:
    """One request in the engine, whatever its kind."""

    uid: int
    job: PreparedRequest
    plan: Plan  # auto re-plans after every canvas, block and round
    remaining: int  # tokens still to compute (whole canvases)
    emitted: int = 0  # tokens handed out
    started: float = 0.0  # when the current canvas, block or round began (auto's pace)
    on_step: Callable[[Draft], None] | None = None  # diffusion: called with every step's draft

    @property
    def planner(self):
        return self.job.planner

    @property
    def temperature(self) -> float:
        return self.job.temperature


def layout_rule(row: Row, tokenizer, vocab: int):
    """A template row's rule (literal tokens forced, holes decoded greedily in their class) or a
    grammar row's (each token among those the grammar allows, greedy or sampled)."""
    job = row.job
    if job.grammar is not None:
        return GrammarRule(job.grammar, vocab, row.remaining, row.temperature, job.rng, row.plan.settings.filters)
    return TemplateRule(job.template, tokenizer, vocab, job.end_of_turn)


def stopped(job: PreparedRequest, rule, tokens: list[int]) -> bool:
    """Whether an answer ended by itself: a template's layout is whole, a grammar reached its end,
    or the last token is a stop id."""
    if job.grammar is not None and rule is not None and rule.finished:
        return True
    return job.template is not None or bool(tokens) and tokens[-1] in job.stop_ids
