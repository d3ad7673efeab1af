"""The engine: every request, alone or among others, runs through ``BatchGenerator`` (a single request
is a batch of one). Each row decodes by its plan's kind, and rows of a kind share forwards:

- diffusion rows are batched step by step (continuous batching): every row keeps its own cache, and
  the rows whose canvases have the same length denoise together, one forward per step, through a
  view that stacks their prefixes left-padded (cache.py). A row whose canvas commits encodes it and
  starts its next canvas at the next step while the others go on; a new request joins at the next
  step, so no row waits for another's canvas to settle;
- autoregressive rows share one left-padded cache and take one token per step, all rows in one
  forward, each greedy, sampled at its own temperature through its own draws, or led by its
  template (drafting.TemplateRule);
- verified drafting rows each keep their own cache; the rows whose drafts take the same number of
  steps draft together (one forward per draft step) and are verified in one encoder pass, each
  keeping what it keeps (drafting.verify_rounds).

An ``auto`` row re-plans after every canvas, autoregressive block and verified round
(policy.AutoPlanner) and moves to the kind it chose; at a switch everything it emitted is in its
cache and it holds the next-token logits after it. Each row keeps its own draws and settings, so a
row gives the text it gives alone. Every commit goes out through one ``emit`` that applies the stop
ids, ``max_tokens`` and the detokenisation.
"""

from __future__ import annotations

from . import fast_blas

fast_blas.load()  # the fast BLAS before mlx.core loads

import itertools  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Callable  # noqa: E402

import mlx.core as mx  # noqa: E402

from . import drafting  # noqa: E402
from .cache import CanvasView  # noqa: E402
from .denoise import new_run, step_batch, step_compacted  # noqa: E402
from .filters import penalized, sampling_probs  # noqa: E402
from .grammar import GrammarRule  # noqa: E402
from .images import images_after  # noqa: E402
from .options import PREFILL_STEP_SIZE, GenerationArgs  # noqa: E402
from .policy import Plan  # noqa: E402
from .request import PreparedRequest, cut_at_stop, generation_device, prefill, prepare  # noqa: E402
from .sampler import CanvasRun, Draft, RunBatch  # noqa: E402

AR_BLOCK_MIN = 4  # tokens an auto row decodes autoregressively before it chooses again


@dataclass
class BatchResponse:
    """What one step committed for a request."""

    uid: int
    tokens: list[int]  # committed by this step (a canvas, a token, a block or a verified round)
    text: str  # the text they add
    finish_reason: str | None  # "stop", "length", or None while more follow
    steps: int  # forwards the commit took (denoising steps of the canvas, tokens, draft steps + the verifying pass)
    plan: Plan | None = None  # the plan the commit was made under (auto re-plans)
    ends_block: bool = True  # False: an autoregressive token inside its block (a canvas's worth, or auto's choice)
    non_pad: int = 0  # non-pad tokens the commit computed, past max_tokens too (the reference's tokens per forward)


@dataclass
class _Row:
    uid: int
    job: PreparedRequest
    clamps: list | None  # a template's (length, Clamp) per canvas
    plan: Plan
    remaining: int  # tokens still to compute (whole canvases)
    cache: object = None  # the row's own cache (None while it is in the autoregressive group)
    on_prefilled: Callable[[object], None] | None = None
    on_step: Callable[[Draft], None] | None = None  # diffusion: called with every step's draft
    canvas: int = 0  # canvases committed
    emitted: int = 0  # tokens handed out
    logits: mx.array | None = None  # the next-token logits after the cache, while the row changes kind
    started: float = 0.0  # auto: when the current canvas, block or round began
    run: CanvasRun | None = None  # diffusion: the canvas being denoised
    token: mx.array | None = None  # autoregressive: the row's next token, decided, not encoded, [1, 1]
    block: int | None = None  # autoregressive under auto: tokens left before it chooses again
    block_size: int = 0  # ... of a block of this many
    canvas_tokens: int = 0  # diffusion: tokens the last canvas gave (up to a stop id)
    rule: object = None  # verified, or a template decoded autoregressively: what decides the tokens
    known: int | None = None  # verified: the next token (decided, not yet encoded); None when done
    leftover: list[int] = field(default_factory=list)  # verified: the last draft's tail (the next one's start)
    first: list[int] = field(default_factory=list)  # verified: tokens decided on entering, sent with the first round
    history: list[int] | None = None  # autoregressive with penalties: the prompt and the tokens decided

    @property
    def planner(self):
        return self.job.planner

    @property
    def temperature(self) -> float:
        return self.job.temperature


@dataclass
class _Lane:
    """Diffusion rows whose canvases share a length and a kind of run (plain ones with one stop rule,
    or compacted ones): one forward per step, through their views stacked (``view``'s rows are
    ``rows``, in order)."""

    rows: list[_Row]
    view: CanvasView
    batch: RunBatch | None = None  # plain runs; None: compacted runs, stepped by step_compacted

    def join(self, row: _Row, view: CanvasView) -> None:
        """``row``, whose canvas starts now, with its prefix laid out in ``view``."""
        self.rows.append(row)
        self.view = CanvasView.stack([self.view, view])
        if self.batch is not None:
            self.batch.add([row.run])

    def step(self, model) -> tuple[list[_Row], CanvasView]:
        """One denoising step of every row; returns the rows whose canvases committed (they leave)
        and a view that still holds all the rows' prefixes (their commits encode through it)."""
        before = self.view
        if self.batch is not None:
            view = step_batch(model, self.view, self.batch)
            keep = [i for i, row in enumerate(self.rows) if row.run.result is None]
        else:
            view, keep = step_compacted(model, self.view, [row.run for row in self.rows])
        done = [row for row in self.rows if row.run.result is not None]
        self.rows, self.view = [self.rows[i] for i in keep], view
        return done, before

    def leave(self, keep: list[int]) -> None:
        self.rows = [self.rows[i] for i in keep]
        if self.batch is not None:
            self.batch.select(keep)
        if keep:
            self.view = self.view.select(keep)


@dataclass
class _Group:
    """Autoregressive rows: one left-padded cache, one forward per token."""

    rows: list[_Row] = field(default_factory=list)
    cache: object = None

    def add(self, row: _Row, cache) -> None:
        if self.cache is None:
            self.cache = cache
        else:
            self.cache.extend(cache)
        self.rows.append(row)

    def take(self, i: int):
        """Row ``i``'s own cache, unpadded (the group's own when it is the only row)."""
        return self.cache if len(self.rows) == 1 else self.cache.row(i)

    def keep(self, keep: list[int]) -> None:
        self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            self.cache = None
        elif len(keep) < self.cache.batch_size:
            self.cache.filter(keep)


class BatchGenerator:
    """Requests in, steps out: ``insert`` queues a request, ``next`` runs one step for every row and
    returns what each committed, ``remove`` drops a row (a client that went away)."""

    def __init__(self, model, tokenizer, prefill_step_size: int = PREFILL_STEP_SIZE, kv_quantization=None):
        self.model, self.tokenizer, self.prefill_step_size = model, tokenizer, prefill_step_size
        self.kv_quantization = kv_quantization  # options.KVQuantization of the caches it makes
        self._uids = itertools.count()
        self._pending: list[_Row] = []
        self._ar = _Group()
        self._diffusion: list[_Row] = []
        self._lanes: dict[tuple[int, int], _Lane] = {}
        self._verifying: list[_Row] = []
        self._out: list[BatchResponse] = []

    def __len__(self) -> int:
        return len(self._pending) + len(self._diffusion) + len(self._ar.rows) + len(self._verifying)

    def insert(self, job: PreparedRequest, cache=None, on_prefilled: Callable[[object], None] | None = None,
               on_step: Callable[[Draft], None] | None = None) -> int:
        """Queue a request ``prepare`` made ready. ``cache``: one row (``model.make_cache()``) already
        holding ``job.ids[:cache.offset]`` (a prefix a server's prompt cache kept, whole images
        included): only the rest of the prompt is encoded. ``on_prefilled`` is called with the row's
        cache once the prompt is in it (generation goes on appending to it); ``on_step`` with each
        denoising step's draft."""
        if cache is not None and cache.offset >= len(job.ids):
            raise ValueError(f"the prompt cache holds {cache.offset} ids of a {len(job.ids)}-id prompt; "
                             "at least its last id must be left to encode")
        row = _Row(next(self._uids), job, job.canvas_clamps(self.tokenizer, self.model.config), job.plan,
                   job.max_tokens, cache=cache, on_prefilled=on_prefilled, on_step=on_step)
        self._pending.append(row)
        return row.uid

    def remove(self, uid: int) -> None:
        self._pending = [r for r in self._pending if r.uid != uid]
        self._verifying = [r for r in self._verifying if r.uid != uid]
        self._diffusion = [r for r in self._diffusion if r.uid != uid]
        for key, lane in list(self._lanes.items()):
            keep = [i for i, r in enumerate(lane.rows) if r.uid != uid]
            if len(keep) < len(lane.rows):
                lane.leave(keep)
                if not lane.rows:
                    del self._lanes[key]
        keep = [i for i, r in enumerate(self._ar.rows) if r.uid != uid]
        if len(keep) < len(self._ar.rows):
            self._ar.keep(keep)

    def next(self) -> list[BatchResponse]:
        """One step: the queued requests' prompts encoded, then a denoising step of every diffusion
        row, a token of every autoregressive row and a round of every verified row; what each row
        committed."""
        self.admit()
        self._diffusion_step()
        self._ar_round()
        self._verified_round()
        out, self._out = self._out, []
        return out

    # -- joining --------------------------------------------------------------------------------

    def admit(self) -> None:
        """Encode the queued requests' prompts (the fresh ones in one forward, left-padded; a cached
        prefix's or an image's row alone) and start each row in its plan's kind."""
        pending, self._pending = self._pending, []
        needs_logits = any(_wants_logits(row) for row in pending)
        fresh = [r for r in pending if r.cache is None and not r.job.vision_inputs]
        if fresh:
            longest = max(len(r.job.ids) for r in fresh)
            padding = [longest - len(r.job.ids) for r in fresh]
            ids = mx.array([[0] * p + r.job.ids for p, r in zip(padding, fresh)], dtype=mx.int32)
            cache = self.model.make_cache(padding, self.kv_quantization)
            self._join(fresh, cache, prefill(self.model, ids, cache, self.prefill_step_size, logits=needs_logits))
        for row in pending:
            if row in fresh:
                continue
            cache = row.cache if row.cache is not None else self.model.make_cache(None, self.kv_quantization)
            images = images_after(row.job.ids, row.job.vision_inputs, cache.offset, self.model.config.image_token_id)
            logits = prefill(self.model, mx.array(row.job.ids[cache.offset:]), cache, self.prefill_step_size,
                             logits=_wants_logits(row), **images)
            self._join([row], cache, logits)

    def _join(self, rows: list[_Row], cache, logits: mx.array | None) -> None:
        """Start prefilled ``rows`` (``cache``'s rows, in order; ``logits`` their next-token logits)."""
        for i, row in enumerate(rows):
            row.cache = cache if len(rows) == 1 else cache.row(i)
            if row.on_prefilled is not None:
                row.on_prefilled(row.cache)
            row.logits = None if logits is None else logits[i : i + 1]
            self._enter(row)

    def _enter(self, row: _Row) -> None:
        """Start ``row``'s next canvas, block or round in its plan's kind, from its own cache (and the
        next-token logits after it)."""
        row.started = time.perf_counter()
        mode = row.plan.mode
        if mode == "diffusion":
            self._diffusion.append(row)
        elif mode == "ar":
            self._enter_ar(row)
        else:
            self._enter_verified(row)
        row.logits = None

    def _choose(self, row: _Row) -> None:
        """An auto row that goes on: its next plan, from what the planner knows by now."""
        row.plan = row.planner.choose(row.remaining, row.job.overrides, row.emitted, row.job.ids)

    # -- emitting -------------------------------------------------------------------------------

    def _emit(self, row: _Row, tokens: list[int], forwards: int, stopped: bool, last: bool,
              ends_block: bool = True) -> bool:
        """Hand out ``tokens`` the row committed (stopped: they end with a stop id or the template's
        end; last: nothing follows them), within ``max_tokens``, with their text; returns whether
        the row is done (the caller takes it out of its kind's rows)."""
        job = row.job
        non_pad = sum(t != job.defaults.pad_token_id for t in tokens)
        room = job.max_tokens - row.emitted
        if job.template is None and len(tokens) >= room:  # a canvas may compute more than was asked for
            stopped, last, tokens = stopped and len(tokens) <= room, True, tokens[:room]
        row.emitted += len(tokens)
        finish = "stop" if stopped else "length" if last else None
        if finish is not None and row.planner is not None:
            row.planner.observe_answer(row.emitted, job.ids)
        self._out.append(BatchResponse(row.uid, tokens, job.text.add(tokens, final=finish is not None), finish,
                                       max(forwards, 1), row.plan, ends_block or finish is not None, non_pad))
        return finish is not None

    # -- diffusion ------------------------------------------------------------------------------

    def _diffusion_step(self) -> None:
        for row in self._diffusion:
            if row.run is None:
                self._start_canvas(row)
        for key, lane in list(self._lanes.items()):
            rows = lane.rows
            done, view = lane.step(self.model)
            if not lane.rows:
                del self._lanes[key]
            if done:
                self._commit(done, view, [rows.index(row) for row in done])

    def _start_canvas(self, row: _Row) -> None:
        plan, full = row.plan, self.model.config.canvas_length
        length, clamp = row.clamps[row.canvas] if row.clamps else (plan.last_canvas_length(row.remaining, full), None)
        row.run = new_run(self.model, plan.settings, row.job.rng, length, clamp, row.on_step)
        view = row.cache.canvas_view(length)
        plain = type(row.run) is CanvasRun
        key = (length, plan.settings.stability_threshold if plain else -1)
        if key in self._lanes:
            self._lanes[key].join(row, view)
        else:
            self._lanes[key] = _Lane([row], view, RunBatch([row.run]) if plain else None)

    def _commit(self, rows: list[_Row], view: CanvasView, indexes: list[int]) -> None:
        """Emit the rows' committed canvases (``view``'s rows ``indexes``); the rows that go on encode
        them, together (their next canvases start at the next step; an auto row's next plan starts
        from the logits after it), finished ones leave."""
        results = [row.run.result for row in rows]
        going_on = [i for i, row in enumerate(rows) if not self._committed(row)]
        if not going_on:
            return
        hidden = any(rows[i].planner is not None for i in going_on)
        if len(going_on) == 1:
            row = rows[going_on[0]]
            out = self.model.encode(results[going_on[0]].tokens, row.cache, return_hidden=hidden)
            mx.eval(row.cache.state())
        else:
            view = view.select([indexes[i] for i in going_on])
            out = self.model.encode(mx.concatenate([results[i].tokens for i in going_on]), view, return_hidden=hidden)
            view.append_canvas([rows[i].cache for i in going_on])
            mx.eval([rows[i].cache.state() for i in going_on])
        for j, i in enumerate(going_on):
            row = rows[i]
            if row.planner is not None:  # the commit's encode is part of the canvas's cost
                row.logits = self.model.head(out[j : j + 1, -1])
                mx.eval(row.logits)
                self._observe_canvas(row, results[i])
                self._diffusion.remove(row)
                self._choose(row)
                self._enter(row)

    def _committed(self, row: _Row) -> bool:
        """Emit the row's committed canvas; returns whether the row is done (it leaves)."""
        result, length = row.run.result, row.run.length
        committed = result.tokens[0].tolist()
        row.run = None
        row.canvas += 1
        row.remaining -= length
        if row.clamps:  # a template's canvases stay whole; it ends with its last one
            tokens, stopped = committed, row.canvas == len(row.clamps)
        else:
            tokens, stopped = cut_at_stop(committed, row.job.stop_ids)
        row.canvas_tokens = len(tokens)
        last = stopped or row.remaining <= 0
        if last and row.planner is not None:  # said before the answer's end
            self._observe_canvas(row, result)
        done = self._emit(row, tokens, result.steps, stopped, last)
        if done:
            self._diffusion.remove(row)
        return done

    def _observe_canvas(self, row: _Row, result) -> None:
        name = "fast" if row.plan.settings.freeze_after else "reference"
        row.planner.observe_canvas(name, result.steps, result.tokens.shape[1], time.perf_counter() - row.started,
                                   row.canvas_tokens, row.job.ids)

    # -- autoregressive -------------------------------------------------------------------------

    def _enter_ar(self, row: _Row) -> None:
        job = row.job
        if job.template is not None or job.grammar is not None:  # the rule decides each token on the host
            row.rule = self._layout_rule(row)
            token = row.rule.step(row.logits)
            if token is None or row.rule.done:  # nothing to feed: the template is whole
                self._emit(row, row.rule.output, 0, True, True)
                return
            row.token = mx.array([[token]], dtype=mx.int32)
        else:
            self._new_block(row)
            row.token = _pick(row, row.logits)
        self._ar.add(row, row.cache)
        row.cache = None

    def _layout_rule(self, row: _Row):
        """A template row's rule (literal tokens forced, holes decoded greedily in their class) or a
        grammar row's (each token among those the grammar allows, greedy or sampled)."""
        job, vocab = row.job, self.model.config.vocab_size
        if job.grammar is not None:
            return GrammarRule(job.grammar, vocab, row.remaining, row.temperature, job.rng, row.plan.settings.filters)
        return drafting.TemplateRule(job.template, self.tokenizer, vocab, job.end_of_turn)

    def _new_block(self, row: _Row) -> None:
        row.block_size = self.model.config.canvas_length
        if row.planner is not None:  # a block as long as the answer is expected still to be
            expected = math.ceil(row.planner.expected_tokens(row.emitted, row.job.ids))
            row.block_size = min(row.block_size, row.remaining, max(AR_BLOCK_MIN, expected))
        row.block = row.block_size

    def _ar_round(self) -> None:
        """A token of every autoregressive row in one forward; the next tokens are queued before the
        current ones are read, so the host never waits on an idle device."""
        group = self._ar
        if not group.rows:
            return
        tokens = mx.concatenate([row.token for row in group.rows])
        logits = self.model.next_token_logits(tokens, group.cache)
        # No token is drawn after a row's last one (a row's draws stay those it makes alone); a
        # template row decides on the host.
        following = [_pick(row, logits[i : i + 1]) if row.rule is None and not _ends(row) else None
                     for i, row in enumerate(group.rows)]
        mx.async_eval([f for f in following if f is not None])
        keep, leaving = [], []
        for i, (row, token) in enumerate(zip(group.rows, tokens[:, 0].tolist())):
            state = self._template_token(row, logits[i]) if row.rule is not None else self._ar_token(row, token)
            if state == "on":
                keep.append(i)
                row.token = following[i] if row.rule is None else row.token
            elif state == "switch":  # an auto row's block is done: another block stays in the group
                self._choose(row)
                if row.plan.mode == "ar":
                    row.started = time.perf_counter()
                    self._new_block(row)
                    row.token = _pick(row, logits[i : i + 1])
                    keep.append(i)
                else:
                    leaving.append((row, group.take(i), logits[i : i + 1]))
        group.keep(keep)
        for row, cache, row_logits in leaving:
            row.cache, row.logits, row.token, row.block = cache, row_logits, None, None
            self._enter(row)

    def _ar_token(self, row: _Row, token: int) -> str:
        """A free row's token: "on", "done", or "switch" (an auto row's block is done: it chooses again)."""
        row.remaining -= 1
        row.block -= 1
        stopped = token in row.job.stop_ids
        last = stopped or row.remaining <= 0
        if row.planner is not None and (last or row.block == 0):
            row.planner.observe_ar(row.block_size - row.block, time.perf_counter() - row.started, row.job.ids)
        if self._emit(row, [token], 1, stopped, last, row.block == 0):
            return "done"
        if row.block == 0:
            if row.planner is not None:
                return "switch"
            row.block = row.block_size
        return "on"

    def _template_token(self, row: _Row, logits: mx.array) -> str:
        """A template row's next decision after ``logits`` [V] (the output it adds: the token, or a
        closed hole's padding too): "on" or "done"."""
        token = row.rule.step(logits)
        done = token is None or row.rule.done
        stopped = done and self._stopped(row, row.rule.output)
        if self._emit(row, row.rule.output[row.emitted:], 1, stopped, done, False) or done:
            return "done"
        row.token = mx.array([[token]], dtype=mx.int32)
        return "on"

    # -- verified drafting ----------------------------------------------------------------------

    def _enter_verified(self, row: _Row) -> None:
        """Decide the next token from the logits after the cache (it goes out with the first round)."""
        job = row.job
        row.rule = (self._layout_rule(row) if job.template is not None or job.grammar is not None
                    else drafting.SampledRule(job.stop_ids, row.remaining, row.temperature, job.rng,
                                              row.plan.settings.filters) if row.temperature
                    else drafting.GreedyRule(job.stop_ids, row.remaining))
        _, row.known = row.rule.follow(row.logits, [])
        row.first, row.leftover = row.rule.output[:], []
        self._verifying.append(row)

    def _verified_round(self) -> None:
        """A verified round of every verified row: rows with the same draft steps draft and are
        verified together, at the longest of their draft lengths (a longer draft than a row's plan
        costs the row only positions of a forward it shares; what it keeps is still verified). A row
        that samples drafts at its own length and temperature, so its draws are those it makes alone."""
        groups: dict[tuple, list[_Row]] = {}
        for row in list(self._verifying):
            if row.known is None:  # the token decided on entering ended it
                self._verifying.remove(row)
                self._emit(row, row.first, 0, self._stopped(row, row.first), True)
                continue
            length = _draft_length(row)
            groups.setdefault((row.plan.draft_steps, row.temperature, length if row.temperature else 0), []).append(row)
        for (steps, temperature, _), rows in groups.items():
            length = max(map(_draft_length, rows))
            rounds = drafting.verify_rounds(self.model, [r.cache for r in rows], [r.known for r in rows],
                                            [r.rule for r in rows], drafting.DraftSettings(length, steps, temperature),
                                            [r.plan.settings for r in rows], [r.job.rng for r in rows],
                                            [r.leftover for r in rows])
            for row, done in zip(rows, rounds):
                self._after_round(row, done, steps)

    def _after_round(self, row: _Row, done: drafting.Round, steps: int) -> None:
        finished = done.known is None
        rejected = not finished and done.kept < done.length - 1
        if row.planner is not None:
            row.planner.observe_round(done.length, steps, done.kept, rejected, len(done.tokens),
                                      time.perf_counter() - row.started, final=finished, prompt=row.job.ids)
        elif row.job.acceptance is not None and done.length > 1:
            row.job.acceptance.observe(steps, done.length, done.kept, rejected)
        # An auto row drafts afresh each round (no leftover start), as its plan may change between rounds.
        row.known, row.leftover = done.known, done.leftover if row.planner is None else []
        tokens, row.first = row.first + done.tokens, []
        row.remaining -= len(tokens)
        if self._emit(row, tokens, done.forwards, finished and self._stopped(row, tokens), finished):
            self._verifying.remove(row)
            return
        if row.planner is None:
            return
        self._choose(row)
        row.started = time.perf_counter()
        if row.plan.mode != "verified":  # leaving verified drafting: the decided token goes into the cache
            self._verifying.remove(row)
            row.logits = self.model.next_token_logits(mx.array([[row.known]]), row.cache)
            row.known = row.rule = None
            self._enter(row)

    def _stopped(self, row: _Row, tokens: list[int]) -> bool:
        """Whether the row's answer ended by itself: a template's layout is whole, a grammar reached
        its end, or the last token is a stop id."""
        if row.job.grammar is not None and row.rule is not None and row.rule.finished:
            return True
        return row.job.template is not None or bool(tokens) and tokens[-1] in row.job.stop_ids


def _wants_logits(row: _Row) -> bool:
    """Whether a row starts from the prompt's next-token logits (autoregressive, verified or auto)."""
    return row.plan.mode != "diffusion" or row.planner is not None


def next_token(logits: mx.array, temperature: float, rng, filters: tuple = ()) -> mx.array:
    """The token [1, 1] after ``logits`` [1, V], lazily: greedy, or drawn through ``rng`` at ``temperature``
    through the ``filters`` (top_p, top_k, min_p: ``filters.sampling_probs``)."""
    if temperature:
        return rng.categorical(sampling_probs(logits, temperature, *filters))[:, None]
    return logits.argmax(-1, keepdims=True).astype(mx.int32)


def _pick(row: _Row, logits: mx.array) -> mx.array:
    """The row's next token, decided (lazily, unless penalties need it on the host for the next one)."""
    settings = row.plan.settings
    if not settings.penalizing:
        return next_token(logits, row.temperature, row.job.rng, settings.filters)
    if row.history is None:
        row.history = list(row.job.ids)
    token = next_token(penalized(logits, row.history, *settings.penalties), row.temperature, row.job.rng,
                       settings.filters)
    row.history.append(token.item())
    return token


def _ends(row: _Row) -> bool:
    """Whether the row's next token is its last (no token is drawn after it) or its auto block's."""
    return row.remaining == 1 or row.planner is not None and row.block == 1


def _draft_length(row: _Row) -> int:
    return max(1, min(row.plan.draft_length, row.rule.room))


def batch_generate(model, tokenizer, prompts: list[str | list[int]], max_tokens: int | None = None, *,
                   seeds: list[int | None] | None = None, **kwargs) -> list[str]:
    """The answers to ``prompts`` generated together; the i-th equals
    ``generate(model, tokenizer, prompts[i], max_tokens, seed=seeds[i], **kwargs)`` (``kwargs``: those
    of ``stream_generate``)."""
    seeds = list(seeds) if seeds is not None else [None] * len(prompts)
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds; give one seed per prompt")
    args = [GenerationArgs.of(max_tokens=max_tokens, seed=seed, **kwargs) for seed in seeds]
    generator = BatchGenerator(model, tokenizer, args[0].prefill_step_size if args else PREFILL_STEP_SIZE,
                               args[0].kv_quantization if args else None)
    uids = [generator.insert(prepare(model, tokenizer, p, a)) for p, a in zip(prompts, args)]
    texts = {uid: "" for uid in uids}
    with generation_device(model):
        while len(generator):
            for response in generator.next():
                texts[response.uid] += response.text
    return [texts[uid] for uid in uids]
