"""The engine's rows by kind (batch.py drives them): ``diffusion`` (canvases, lanes of rows denoised
together), ``autoregressive`` (one left-padded cache, a token per row per forward) and ``verified``
(drafts verified by the encoder, rows of one draft shape in one round). Each kind owns its rows' state
and has ``add(row, cache, logits)`` (start a row from its own cache and the next-token logits after
it), ``step()`` (one forward's worth for every row), ``remove(uid)`` and ``len``. A kind is made with
the engine and calls back into it: ``emit`` hands out what a row committed, ``replan`` asks an auto
row's planner for its next plan and ``enter`` starts a row in its plan's kind.

``Row`` is what every kind knows of a request; the rules that decide a row's tokens on the host are
rules.py's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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
    draft: str = ""  # a drafting row's text so far (a drafted schema's free draft: never handed out)
    prompt_cache: object = None  # a drafting row's prompt, encoded: its answer starts from it

    @property
    def planner(self):
        return self.job.planner

    @property
    def temperature(self) -> float:
        return self.job.temperature
