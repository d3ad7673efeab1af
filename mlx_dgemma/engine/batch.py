"""The engine: every request, alone or among others, runs through ``BatchGenerator`` (a single request
is a batch of one). It admits requests (their prompts encoded, the fresh ones in one forward), starts
each row in its plan's kind and hands out what rows commit (``emit``); the kinds (rows/) own their
rows and share forwards among them:

- diffusion rows are batched step by step: the rows whose canvases have the same length denoise
  together, one forward per step, and a row whose canvas commits starts its next canvas at the next
  step while the others go on (rows/diffusion.py);
- autoregressive rows share one left-padded cache and take one token per step, all rows in one
  forward (rows/autoregressive.py);
- verified drafting rows with the same draft steps draft together and are verified in one encoder
  pass (rows/verified.py, drafting.verify_rounds).

An ``auto`` row re-plans after every canvas, autoregressive block and verified round
(policy.AutoPlanner) and moves to the kind it chose; at a switch everything it emitted is in its
cache and it holds the next-token logits after it. A drafted schema's row (structured/layout.py)
generates its free draft first, handing nothing out; the engine then plans the answer on the
schema's template sized by the draft and runs it as the same request, from the prompt encoded once.
Each row keeps its own draws and settings, so a row gives the text it gives alone. Every commit goes out through one ``emit`` that applies the stop
ids, ``max_tokens`` and the detokenisation.
"""

from __future__ import annotations

import copy
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from ..cpu_threads import follow_free_cores
from ..model.images import images_after
from ..options import PREFILL_STEP_SIZE
from .policy import Plan
from .request import PreparedRequest, plan
from .rows import Row
from .rows.autoregressive import AutoregressiveRows
from .rows.diffusion import DiffusionRows
from .rows.verified import VerifiedRows
from .sampler import Draft


def prefill(
    model, ids: mx.array, cache, step_size: int = PREFILL_STEP_SIZE, logits: bool = False, **vision_inputs
) -> mx.array | None:
    """Encode prompt rows ``ids`` [B, T] into ``cache`` ``step_size`` tokens at a time, evaluating
    after each chunk so that peak memory is one chunk's activations, not the whole prompt's. With
    ``logits``, the next-token logits [B, V] after the prompt (autoregressive decoding starts there).
    A prompt with images goes in one forward (an image block attends to itself both ways)."""
    ids = mx.array(ids, dtype=mx.int32)
    ids = ids.reshape(1, -1) if ids.ndim == 1 else ids
    T = ids.shape[1]
    if vision_inputs:
        step_size = T
    for start in range(0, T, step_size):
        chunk = ids[:, start : start + step_size]
        if logits and start + step_size >= T:
            out = model.next_token_logits(chunk, cache, **vision_inputs)
            mx.eval(out, cache.state())
            return out
        model.encode(chunk, cache, **vision_inputs)
        mx.eval(cache.state())
    return None


@dataclass
class StepResponse:
    """What one step committed for a request."""

    uid: int
    tokens: list[int]  # committed by this step (a canvas, a token, a block or a verified round)
    text: str  # the text they add
    finish_reason: str | None  # "stop", "length", or None while more follow
    steps: int  # forwards the commit took (denoising steps of the canvas, tokens, draft steps + the verifying pass)
    plan: Plan | None = None  # the plan the commit was made under (auto re-plans)
    ends_block: bool = True  # False: an autoregressive token inside its block (a canvas's worth, or auto's choice)
    non_pad: int = 0  # non-pad tokens the commit computed, past max_tokens too (the reference's tokens per forward)
    error: Exception | None = None  # the row failed: it is out of the engine, nothing else is set


class BatchGenerator:
    """Requests in, steps out: ``insert`` queues a request, ``next`` runs one step for every row and
    returns what each committed, ``remove`` drops a row (a client that went away)."""

    def __init__(self, model, tokenizer, prefill_step_size: int = PREFILL_STEP_SIZE, kv_quantization=None):
        self.model, self.tokenizer, self.prefill_step_size = model, tokenizer, prefill_step_size
        self.kv_quantization = kv_quantization  # options.KVQuantization of the caches it makes
        self._uids = itertools.count()
        self._pending: list[tuple[Row, object, Callable[[object], None] | None]] = []  # row, prefix cache, on_prefilled
        self._kinds = {"diffusion": DiffusionRows(self), "ar": AutoregressiveRows(self), "verified": VerifiedRows(self)}
        self._out: list[StepResponse] = []
        self._crowded_until = -math.inf  # the end of the last step that ran more than one row

    def alone(self, row: Row) -> bool:
        """Whether ``row`` has been the only row since its current canvas, block or round began: its
        forwards were its own, so their time is the device's (auto's live profile learns from it)."""
        return self._crowded_until < row.started

    def __len__(self) -> int:
        return len(self._pending) + sum(len(kind) for kind in self._kinds.values())

    def insert(
        self,
        job: PreparedRequest,
        cache=None,
        on_prefilled: Callable[[object], None] | None = None,
        on_step: Callable[[Draft], None] | None = None,
    ) -> int:
        """Queue a request ``prepare`` made ready. ``cache``: one row (``model.make_cache()``) already
        holding ``job.ids[:cache.offset]`` (a prefix a server's prompt cache kept, whole images
        included): only the rest of the prompt is encoded. ``on_prefilled`` is called with the row's
        cache once the prompt is in it (generation goes on appending to it); ``on_step`` with each
        denoising step's draft."""
        if cache is not None and cache.offset >= len(job.ids):
            raise ValueError(
                f"the prompt cache holds {cache.offset} ids of a {len(job.ids)}-id prompt; "
                "at least its last id must be left to encode"
            )
        row = Row(next(self._uids), job, job.plan, job.max_tokens, on_step=on_step)
        self._pending.append((row, cache, on_prefilled))
        return row.uid

    def remove(self, uid: int) -> None:
        self._pending = [entry for entry in self._pending if entry[0].uid != uid]
        for kind in self._kinds.values():
            kind.remove(uid)

    def next(self) -> list[StepResponse]:
        """One step: the queued requests' prompts encoded, then a denoising step of every diffusion
        row, a token of every autoregressive row and a round of every verified row; what each row
        committed."""
        follow_free_cores()
        self.admit()
        crowded = len(self) > 1
        if crowded:
            self._crowded_until = math.inf
        for kind in self._kinds.values():
            kind.step()
        if crowded:
            self._crowded_until = time.perf_counter()
        out, self._out = self._out, []
        return out

    def admit(self) -> None:
        """Encode the queued requests' prompts (the fresh ones in one forward, left-padded; a cached
        prefix's or an image's row alone) and start each row in its plan's kind."""
        pending, self._pending = self._pending, []
        needs_logits = any(_wants_logits(row) for row, _, _ in pending)
        fresh = [entry for entry in pending if entry[1] is None and not entry[0].job.vision_inputs]
        if fresh:
            longest = max(len(row.job.ids) for row, _, _ in fresh)
            padding = [longest - len(row.job.ids) for row, _, _ in fresh]
            ids = mx.array([[0] * p + row.job.ids for p, (row, _, _) in zip(padding, fresh)], dtype=mx.int32)
            cache = self.model.make_cache(padding, self.kv_quantization)
            self._join(fresh, cache, prefill(self.model, ids, cache, self.prefill_step_size, logits=needs_logits))
        for entry in pending:
            if any(entry is f for f in fresh):
                continue
            row, cache, _ = entry
            cache = cache if cache is not None else self.model.make_cache(None, self.kv_quantization)
            images = images_after(row.job.ids, row.job.vision_inputs, cache.offset, self.model.config.image_token_id)
            logits = prefill(
                self.model,
                mx.array(row.job.ids[cache.offset :]),
                cache,
                self.prefill_step_size,
                logits=_wants_logits(row),
                **images,
            )
            self._join([entry], cache, logits)

    def _join(self, entries: list[tuple], cache, logits: mx.array | None) -> None:
        """Start prefilled rows (``cache``'s rows, in order; ``logits`` their next-token logits)."""
        for i, (row, _, on_prefilled) in enumerate(entries):
            own = cache if len(entries) == 1 else cache.row(i)
            if on_prefilled is not None:
                on_prefilled(own)
            if row.job.drafting and len(row.job.ids) > 1:  # the answer's row starts from the prompt but its last id
                row.prompt_cache = copy.deepcopy(own)
                row.prompt_cache.trim(own.offset - (len(row.job.ids) - 1))
            self.enter(row, own, None if logits is None else logits[i : i + 1])

    # -- what the kinds call ---------------------------------------------------------------------

    def enter(self, row: Row, cache, logits: mx.array | None) -> None:
        """Start ``row``'s next canvas, block or round in its plan's kind, from its own ``cache`` (and
        the next-token ``logits`` after it)."""
        row.started = time.perf_counter()
        try:
            self._kinds[row.plan.mode].add(row, cache, logits)
        except Exception as e:  # (a kind takes a row in only once all of its own work is done)
            self.fail(row, e)

    def fail(self, row: Row, error: Exception) -> None:
        """End ``row`` with ``error`` (the kind has let it go): the others go on."""
        self._out.append(StepResponse(row.uid, [], "", None, 0, row.plan, error=error))

    def replan(self, row: Row) -> None:
        """An auto row that goes on: its next plan, from what the planner knows by now."""
        row.plan = row.planner.choose(row.remaining, row.job.overrides, row.emitted, row.job.ids)

    def emit(
        self, row: Row, tokens: list[int], forwards: int, stopped: bool, last: bool, ends_block: bool = True
    ) -> bool:
        """Hand out ``tokens`` the row committed (stopped: they end with a stop id or the template's
        end; last: nothing follows them), within ``max_tokens``, with their text; returns whether
        the row is done (the kind takes it out of its rows)."""
        job = row.job
        non_pad = sum(t != job.defaults.pad_token_id for t in tokens)
        room = job.max_tokens - row.emitted
        if job.template is None and len(tokens) >= room:  # a canvas may compute more than was asked for
            stopped, last, tokens = stopped and len(tokens) <= room, True, tokens[:room]
        row.emitted += len(tokens)
        finish = "stop" if stopped else "length" if last else None
        if finish is not None and row.planner is not None:
            row.planner.observe_answer(row.emitted, job.ids)
        if job.drafting:
            row.draft += job.text.add(tokens, final=finish is not None)
            if finish is not None:
                self._answer(row)
            return finish is not None
        self._out.append(
            StepResponse(
                row.uid,
                tokens,
                job.text.add(tokens, final=finish is not None),
                finish,
                max(forwards, 1),
                row.plan,
                ends_block or finish is not None,
                non_pad,
            )
        )
        return finish is not None

    def _answer(self, row: Row) -> None:
        """A drafting row's draft is in: its answer, planned on the template the draft sizes, runs as
        the same request (the same uid) from the prompt the draft encoded."""
        try:
            job = plan(self.model, self.tokenizer, row.job.resolved.answered(self.tokenizer, row.draft))
        except Exception as e:  # (a template the context cannot hold, a plan the device refuses)
            self.fail(row, e)
            return
        self._pending.append((Row(row.uid, job, job.plan, job.max_tokens, on_step=row.on_step), row.prompt_cache, None))


def warm_up(model, tokenizer) -> None:
    """One small encoding and denoising forward, evaluated: whatever the model builds lazily is built
    on the calling thread."""
    cache = model.make_cache()
    model.encode(mx.array([tokenizer.bos_token_id]), cache)
    mx.eval(model.denoise(mx.zeros((1, 1), dtype=mx.int32), cache))


def _wants_logits(row: Row) -> bool:
    """Whether a row starts from the prompt's next-token logits (autoregressive or verified; an auto
    row whose first canvas is diffused gets its next logits from the canvas's commit, if it switches)."""
    return row.plan.mode != "diffusion"
