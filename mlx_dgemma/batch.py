"""Several prompts through the model at once.

Diffusion rows are batched step by step (continuous batching): every row keeps its own cache, and
the rows whose canvases have the same length denoise together, one forward per step, through a view
that stacks their prefixes left-padded (cache.py). A row whose canvas commits encodes it and starts
its next canvas at the next step while the others go on; a new request joins at the next step. So
no row waits for another's canvas to settle. Autoregressive rows share one left-padded cache and
take one token per step, all rows in one forward. Each row keeps its own draws and settings, so
row i of ``batch_generate`` gives the text ``generate`` gives for that prompt and seed alone.

Verified drafting rows each keep their own cache too; the rows whose drafts take the same number of
steps draft together (one forward per draft step, at the longest of their draft lengths) and are
verified in one encoder pass, each keeping what it keeps (drafting.verify_rounds). Rows that cannot
share a forward (the auto policy, which re-plans per canvas or round; a template decoded
autoregressively or verified) run alone, one canvas, block of tokens or verified round per step,
through ``stream_generate``, from the prefix their request brings.
"""

from __future__ import annotations

from . import fast_blas

fast_blas.load()  # the fast BLAS before mlx.core loads

import itertools  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Callable, Iterator  # noqa: E402

import mlx.core as mx  # noqa: E402

from . import drafting  # noqa: E402
from .cache import CanvasView  # noqa: E402
from .generate import PREFILL_STEP_SIZE, Job, cut_at_stop, generation_device, prefill, prepare, stream_generate  # noqa: E402
from .sampler import CanvasRun, RunBatch, new_run, step_batch, step_compacted  # noqa: E402
from .template import CanvasTemplate  # noqa: E402


@dataclass
class BatchRequest:
    """One prompt for ``BatchGenerator`` (token ids, the chat template already applied)."""

    prompt_ids: list[int]
    max_tokens: int | None = None
    seed: int | None = None
    policy: str = "reference"
    steps: int | None = None
    temp_min: float | None = None
    temp_max: float | None = None
    template: CanvasTemplate | None = None
    # One row (model.make_cache()) already holding prompt_ids[:cache.offset], a prefix kept by a
    # server's prompt cache: only the rest of the prompt is encoded.
    cache: object = None
    # Called with a one-row cache holding the prompt once the engine has encoded it (a server's prompt
    # cache keeps a copy); generation goes on appending to that cache. A row that runs alone (auto, a
    # template decoded autoregressively or verified) hands it over holding all but the prompt's last id.
    on_prefilled: Callable[[object], None] | None = None


@dataclass
class BatchResponse:
    """What one step committed for a request."""

    uid: int
    tokens: list[int]  # committed by this step (a canvas, a token, a block or a verified round)
    text: str  # the text they add
    finish_reason: str | None  # "stop", "length", or None while more follow
    steps: int  # forwards the commit took (denoising steps of the canvas, or tokens)


@dataclass
class _Row:
    uid: int
    job: Job
    clamps: list | None
    canvas: int = 0  # canvases committed
    remaining: int = 0  # tokens still to compute (whole canvases)
    emitted: int = 0  # tokens handed out
    token: mx.array | None = None  # autoregressive: the row's next token, [1, 1]
    solo: Iterator | None = None
    cache: object = None  # a prefilled prefix (BatchRequest.cache); a diffusion row's own cache
    on_prefilled: Callable[[object], None] | None = None
    run: CanvasRun | None = None  # diffusion: the canvas being denoised
    rule: drafting.GreedyRule | None = None  # verified: what decides the tokens, and its output
    known: int | None = None  # verified: the next token (decided, not yet encoded); None when done
    leftover: list[int] = field(default_factory=list)  # verified: the last draft's tail (the next one's start)
    first: list[int] = field(default_factory=list)  # verified: the prompt's next token, sent with the first round


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

    def drop(self, keep: list[int]) -> None:
        self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            self.cache = None
        elif len(keep) < self.cache.batch_size:
            self.cache.filter(keep)


class BatchGenerator:
    """Requests in, steps out: ``insert`` queues a request, ``next`` runs one step for every row and
    returns what each committed, ``remove`` drops a row (a client that went away)."""

    def __init__(self, model, tokenizer, prefill_step_size: int = PREFILL_STEP_SIZE):
        self.model, self.tokenizer, self.prefill_step_size = model, tokenizer, prefill_step_size
        self._uids = itertools.count()
        self._pending: list[_Row] = []
        self._ar = _Group()
        self._diffusion: list[_Row] = []
        self._lanes: dict[tuple[int, int], _Lane] = {}
        self._solo: list[_Row] = []
        self._verifying: list[_Row] = []

    def __len__(self) -> int:
        return len(self._pending) + len(self._diffusion) + len(self._ar.rows) + len(self._solo) + len(self._verifying)

    def insert(self, request: BatchRequest) -> int:
        job = prepare(self.model, self.tokenizer, list(request.prompt_ids), request.max_tokens, steps=request.steps,
                      seed=request.seed, temp_min=request.temp_min, temp_max=request.temp_max,
                      policy=request.policy, template=request.template)
        row = _Row(next(self._uids), job, job.canvas_clamps(self.tokenizer, self.model.config),
                   remaining=job.max_tokens, cache=request.cache, on_prefilled=request.on_prefilled)
        # Rows whose forwards do not line up with others' run alone: auto (re-plans per canvas or round), a
        # template decoded autoregressively or verified (one forced token at a time, drafts clamped by it).
        if job.planner is not None or job.plan.mode in ("ar", "verified") and job.template is not None:
            if row.on_prefilled is not None and row.cache is None:
                row.cache = self.model.make_cache()  # _admit encodes the prompt in it but its last id
            row.solo = stream_generate(self.model, self.tokenizer, job.ids, job.max_tokens, seed=request.seed,
                                       steps=request.steps, temp_min=request.temp_min, temp_max=request.temp_max,
                                       policy=request.policy, template=job.template, prompt_cache=row.cache)
        self._pending.append(row)
        return row.uid

    def remove(self, uid: int) -> None:
        self._pending = [r for r in self._pending if r.uid != uid]
        self._solo = [r for r in self._solo if r.uid != uid]
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
            self._ar.drop(keep)

    def next(self) -> list[BatchResponse]:
        """One step: a denoising step of every diffusion row, a token of every autoregressive row, a
        canvas, block or round of every row that runs alone; what each row committed."""
        self._admit()
        return self._diffusion_step() + self._ar_round() + self._verified_round() + self._solo_round()

    # -- joining --------------------------------------------------------------------------------

    def _admit(self) -> None:
        pending, self._pending = self._pending, []
        for row in pending:
            if row.solo is not None and row.on_prefilled is not None and row.cache.offset < len(row.job.ids) - 1:
                # stream_generate encodes the last id (its logits start the answer); the rest is kept.
                prefill(self.model, mx.array(row.job.ids[row.cache.offset : -1]), row.cache, self.prefill_step_size)
                row.on_prefilled(row.cache)
        self._solo += [r for r in pending if r.solo is not None]
        for mode in ("diffusion", "ar", "verified"):
            rows = [r for r in pending if r.solo is None and r.job.plan.mode == mode]
            cached = [r for r in rows if r.cache is not None]
            if fresh := [r for r in rows if r.cache is None]:
                longest = max(len(r.job.ids) for r in fresh)
                padding = [longest - len(r.job.ids) for r in fresh]
                ids = mx.array([[0] * p + r.job.ids for p, r in zip(padding, fresh)], dtype=mx.int32)
                cache = self.model.make_cache(padding)
                logits = prefill(self.model, ids, cache, self.prefill_step_size, logits=mode != "diffusion")
                self._join(mode, fresh, cache, logits)
            for row in cached:  # a prefix already encoded: only the rest of its prompt
                cache, row.cache = row.cache, None
                logits = prefill(self.model, mx.array(row.job.ids[cache.offset:]), cache, self.prefill_step_size,
                                 logits=mode != "diffusion")
                self._join(mode, [row], cache, logits)

    def _join(self, mode: str, rows: list[_Row], cache, logits: mx.array | None) -> None:
        """Add prefilled ``rows`` (``cache``'s rows, in order): diffusion and verified rows each with its
        own rows of the cache, AR rows to the shared cache (``logits`` give AR and verified rows their
        first tokens)."""
        for i, row in enumerate(rows):
            own = cache if len(rows) == 1 else cache.row(i)
            if row.on_prefilled is not None:
                row.on_prefilled(own)
            if mode != "ar":
                row.cache = own
            if mode == "verified":
                row.rule = drafting.GreedyRule(row.job.stop_ids, row.job.max_tokens)
                _, row.known = row.rule.follow(logits[i : i + 1], [])
                row.first = row.rule.output[:]
        if mode == "diffusion":
            self._diffusion += rows
        elif mode == "verified":
            self._verifying += rows
        else:
            _join_group(self._ar, rows, cache, logits)

    # -- rounds ---------------------------------------------------------------------------------

    def _diffusion_step(self) -> list[BatchResponse]:
        for row in self._diffusion:
            if row.run is None:
                self._start_canvas(row)
        responses = []
        for key, lane in list(self._lanes.items()):
            rows = lane.rows
            done, view = lane.step(self.model)
            if not lane.rows:
                del self._lanes[key]
            if done:
                responses += self._commit(done, view, [rows.index(row) for row in done])
        return responses

    def _start_canvas(self, row: _Row) -> None:
        plan, full = row.job.plan, self.model.config.canvas_length
        length, clamp = row.clamps[row.canvas] if row.clamps else (plan.last_canvas_length(row.remaining, full), None)
        row.run = new_run(self.model, plan.settings, row.job.rng, length, clamp)
        view = row.cache.canvas_view(length)
        plain = type(row.run) is CanvasRun
        key = (length, plan.settings.stability_threshold if plain else -1)
        if key in self._lanes:
            self._lanes[key].join(row, view)
        else:
            self._lanes[key] = _Lane([row], view, RunBatch([row.run]) if plain else None)

    def _commit(self, rows: list[_Row], view: CanvasView, indexes: list[int]) -> list[BatchResponse]:
        """The rows' committed canvases as responses (``view``'s rows ``indexes``); the rows that go on
        encode them, together (their next canvases start at the next step), finished ones leave."""
        responses, tokens = [], []
        for row in rows:
            tokens.append(row.run.result.tokens)
            responses.append(self._committed(row))
        going_on = [i for i, r in enumerate(responses) if r.finish_reason is None]
        if len(going_on) == 1:
            row = rows[going_on[0]]
            self.model.encode(tokens[going_on[0]], row.cache)
            mx.eval(row.cache.state())
        elif going_on:
            view = view.select([indexes[i] for i in going_on])
            self.model.encode(mx.concatenate([tokens[i] for i in going_on]), view)
            view.append_canvas([rows[i].cache for i in going_on])
            mx.eval([rows[i].cache.state() for i in going_on])
        return responses

    def _committed(self, row: _Row) -> BatchResponse:
        """The row's committed canvas as a response; a finished row leaves."""
        result, length = row.run.result, row.run.length
        committed = result.tokens[0].tolist()
        row.run = None
        row.canvas += 1
        row.remaining -= length
        if row.clamps:  # a template's canvases stay whole; it ends with its last one
            tokens, stopped = committed, row.canvas == len(row.clamps)
            last = stopped
        else:
            tokens, stopped = cut_at_stop(committed, row.job.stop_ids)
            last = stopped or row.remaining <= 0
            room = row.job.max_tokens - row.emitted
            if len(tokens) >= room:  # a canvas may compute more than was asked for
                stopped, last, tokens = stopped and len(tokens) <= room, True, tokens[:room]
        row.emitted += len(tokens)
        finish = "stop" if stopped else "length" if last else None
        if finish is not None:
            self._diffusion.remove(row)
        return BatchResponse(row.uid, tokens, row.job.text.add(tokens, final=finish is not None), finish, result.steps)

    def _ar_round(self) -> list[BatchResponse]:
        group = self._ar
        if not group.rows:
            return []
        tokens = mx.concatenate([row.token for row in group.rows])
        following = self.model.next_token_logits(tokens, group.cache).argmax(-1, keepdims=True)
        mx.async_eval(following)  # queued before the current tokens are read
        responses, keep = [], []
        for i, (row, token) in enumerate(zip(group.rows, tokens[:, 0].tolist())):
            row.remaining -= 1
            stopped = token in row.job.stop_ids
            finish = "stop" if stopped else "length" if row.remaining <= 0 else None
            responses.append(BatchResponse(row.uid, [token], row.job.text.add([token], final=finish is not None),
                                           finish, 1))
            if finish is None:
                keep.append(i)
                row.token = following[i : i + 1]
        group.drop(keep)
        return responses

    def _verified_round(self) -> list[BatchResponse]:
        """A verified round of every verified row: rows with the same draft steps draft and are
        verified together, at the longest of their draft lengths (a longer draft than a row's plan
        costs the row only positions of a forward it shares; what it keeps is still verified)."""
        groups: dict[int, list[_Row]] = {}
        responses = []
        for row in self._verifying:
            if row.known is None:  # the prompt's next token ended it
                responses.append(self._verified_response(row, [], True, 0))
                continue
            groups.setdefault(row.job.plan.draft_steps, []).append(row)
        for steps, rows in groups.items():
            length = max(max(1, min(r.job.plan.draft_length, r.rule.room)) for r in rows)
            rounds = drafting.verify_rounds(self.model, [r.cache for r in rows], [r.known for r in rows],
                                            [r.rule for r in rows], length, drafting.DraftSettings(length, steps),
                                            [r.job.plan.settings for r in rows], [r.job.rng for r in rows],
                                            [r.leftover for r in rows])
            for row, done in zip(rows, rounds):
                if row.job.acceptance is not None and length > 1:
                    row.job.acceptance.observe(steps, length, done.kept, done.known is not None and done.kept < length - 1)
                row.known, row.leftover = done.known, done.leftover
                responses.append(self._verified_response(row, done.tokens, done.known is None, done.forwards))
        return responses

    def _verified_response(self, row: _Row, tokens: list[int], done: bool, forwards: int) -> BatchResponse:
        tokens, row.first = row.first + tokens, []
        finish = ("stop" if tokens and tokens[-1] in row.job.stop_ids else "length") if done else None
        if done:
            self._verifying.remove(row)
        return BatchResponse(row.uid, tokens, row.job.text.add(tokens, final=done), finish, max(forwards, 1))

    def _solo_round(self) -> list[BatchResponse]:
        responses = []
        for row in list(self._solo):
            r = next(row.solo)
            responses.append(BatchResponse(row.uid, r.tokens, r.text, r.finish_reason, r.steps))
            if r.finish_reason:
                self._solo.remove(row)
        return responses


def _join_group(group: _Group, rows: list[_Row], cache, logits: mx.array | None) -> None:
    """Add prefilled ``rows`` (``cache``'s rows, in order) to ``group``; ``logits`` start AR rows."""
    if logits is not None:
        first = logits.argmax(-1, keepdims=True)
        for i, row in enumerate(rows):
            row.token = first[i : i + 1]
    if group.cache is None:
        group.cache = cache
    else:
        group.cache.extend(cache)
    group.rows += rows


def batch_generate(model, tokenizer, prompts: list[str | list[int]], max_tokens: int | None = None, *,
                   seeds: list[int | None] | None = None, policy: str = "reference", steps: int | None = None,
                   system_prompt: str | None = None, chat_template: bool = True,
                   prefill_step_size: int = PREFILL_STEP_SIZE) -> list[str]:
    """The answers to ``prompts`` generated together; the i-th equals
    ``generate(model, tokenizer, prompts[i], max_tokens, seed=seeds[i], policy=policy, steps=steps)``."""
    from .generate import prompt_ids

    seeds = list(seeds) if seeds is not None else [None] * len(prompts)
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds; give one seed per prompt")
    generator = BatchGenerator(model, tokenizer, prefill_step_size)
    uids = [generator.insert(BatchRequest(prompt_ids(tokenizer, p, system_prompt, chat_template), max_tokens, seed,
                                          policy, steps))
            for p, seed in zip(prompts, seeds)]
    texts = {uid: "" for uid in uids}
    with generation_device(model):
        while len(generator):
            for response in generator.next():
                texts[response.uid] += response.text
    return [texts[uid] for uid in uids]
