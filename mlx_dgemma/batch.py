"""Several prompts through the model at once.

Rows are left-padded into one cache per mode (cache.py). Diffusion rows move in lock-step rounds: a
round denoises every row's next canvas with one batched forward per step (a row whose canvas has
committed leaves the forward), then encodes every continuing row's commit in one forward; a row
that has finished leaves the cache. Autoregressive rows take one token per round, all rows in one
forward. New requests join at the next round. Each row keeps its own draws and settings, so row i
of ``batch_generate`` gives the text ``generate`` gives for that prompt and seed alone.

Rows that cannot share a forward (verified drafting, the auto policy, a template decoded
autoregressively) run alone, one canvas, block of tokens or verified round per round, through
``stream_generate``.
"""

from __future__ import annotations

from . import fast_blas

fast_blas.load()  # the fast BLAS before mlx.core loads

import itertools  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Iterator  # noqa: E402

import mlx.core as mx  # noqa: E402

from .generate import PREFILL_STEP_SIZE, Job, cut_at_stop, generation_device, prefill, prepare, stream_generate  # noqa: E402
from .sampler import denoise_runs, new_run  # noqa: E402
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


@dataclass
class BatchResponse:
    """What one round added to a request."""

    uid: int
    tokens: list[int]  # committed in this round
    text: str  # the text they add
    finish_reason: str | None  # "stop", "length", or None while more follow
    steps: int  # forwards this round took for the row (denoising steps, or tokens)


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
    cache: object = None  # the request's own prefilled cache, until the row joins its group


@dataclass
class _Group:
    """Rows that share one cache and one forward per step."""

    rows: list[_Row] = field(default_factory=list)
    cache: object = None

    def drop(self, keep: list[int]) -> None:
        self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            self.cache = None
        elif len(keep) < self.cache.batch_size:
            self.cache.filter(keep)


class BatchGenerator:
    """Requests in, rounds out: ``insert`` queues a request, ``next`` runs one round for every row
    and returns what each added, ``remove`` drops a row (a client that went away)."""

    def __init__(self, model, tokenizer, prefill_step_size: int = PREFILL_STEP_SIZE):
        self.model, self.tokenizer, self.prefill_step_size = model, tokenizer, prefill_step_size
        self._uids = itertools.count()
        self._pending: list[_Row] = []
        self._diffusion, self._ar = _Group(), _Group()
        self._solo: list[_Row] = []

    def __len__(self) -> int:
        return len(self._pending) + len(self._diffusion.rows) + len(self._ar.rows) + len(self._solo)

    def insert(self, request: BatchRequest) -> int:
        job = prepare(self.model, self.tokenizer, list(request.prompt_ids), request.max_tokens, steps=request.steps,
                      seed=request.seed, temp_min=request.temp_min, temp_max=request.temp_max,
                      policy=request.policy, template=request.template)
        row = _Row(next(self._uids), job, job.canvas_clamps(self.tokenizer, self.model.config),
                   remaining=job.max_tokens, cache=request.cache)
        # Rows whose forwards do not line up with others' run alone: verified drafting (rounds of their own
        # length), auto (re-plans per canvas or round), an autoregressive template (one forced token at a time).
        if job.plan.mode == "verified" or job.planner is not None or job.plan.mode == "ar" and job.template is not None:
            row.solo = stream_generate(self.model, self.tokenizer, job.ids, job.max_tokens, seed=request.seed,
                                       steps=request.steps, temp_min=request.temp_min, temp_max=request.temp_max,
                                       policy=request.policy, template=job.template)
        self._pending.append(row)
        return row.uid

    def remove(self, uid: int) -> None:
        self._pending = [r for r in self._pending if r.uid != uid]
        self._solo = [r for r in self._solo if r.uid != uid]
        for group in (self._diffusion, self._ar):
            keep = [i for i, r in enumerate(group.rows) if r.uid != uid]
            if len(keep) < len(group.rows):
                group.drop(keep)

    def next(self) -> list[BatchResponse]:
        self._admit()
        return self._diffusion_round() + self._ar_round() + self._solo_round()

    # -- joining --------------------------------------------------------------------------------

    def _admit(self) -> None:
        pending, self._pending = self._pending, []
        self._solo += [r for r in pending if r.solo is not None]
        for mode, group in (("diffusion", self._diffusion), ("ar", self._ar)):
            rows = [r for r in pending if r.solo is None and (r.job.plan.mode == "ar") == (mode == "ar")]
            if fresh := [r for r in rows if r.cache is None]:
                longest = max(len(r.job.ids) for r in fresh)
                padding = [longest - len(r.job.ids) for r in fresh]
                ids = mx.array([[0] * p + r.job.ids for p, r in zip(padding, fresh)], dtype=mx.int32)
                cache = self.model.make_cache(padding)
                logits = prefill(self.model, ids, cache, self.prefill_step_size, logits=mode == "ar")
                _join(group, fresh, cache, logits)
            for row in rows:
                if row.cache is not None:  # a prefix already encoded: only the rest of its prompt
                    cache, row.cache = row.cache, None
                    logits = prefill(self.model, mx.array(row.job.ids[cache.offset:]), cache, self.prefill_step_size,
                                     logits=mode == "ar")
                    _join(group, [row], cache, logits)

    # -- rounds ---------------------------------------------------------------------------------

    def _diffusion_round(self) -> list[BatchResponse]:
        group = self._diffusion
        if not group.rows:
            return []
        full = self.model.config.canvas_length
        runs = []
        for row in group.rows:
            plan = row.job.plan
            length, clamp = row.clamps[row.canvas] if row.clamps else (plan.last_canvas_length(row.remaining, full), None)
            runs.append(new_run(self.model, plan.settings, row.job.rng, length, clamp))
        lengths = sorted({run.length for run in runs})
        results = [None] * len(runs)
        for length in lengths:
            members = [i for i, run in enumerate(runs) if run.length == length]
            view = group.cache.canvas_view(length)
            if len(members) < len(runs):
                view = view.select(members)
            for i, result in zip(members, denoise_runs(self.model, view, [runs[i] for i in members])):
                results[i] = result
        responses, keep, commits = [], [], []
        for i, (row, result) in enumerate(zip(group.rows, results)):
            committed = result.tokens[0].tolist()
            length = runs[i].length
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
            responses.append(BatchResponse(row.uid, tokens, row.job.text.add(tokens, final=finish is not None),
                                           finish, result.steps))
            if finish is None:
                keep.append(i)
                commits.append(result.tokens)
        group.drop(keep)
        if commits:  # every continuing canvas is a full one: the commits join the prefix in one forward
            self.model.encode(mx.concatenate(commits), group.cache)
            mx.eval(group.cache.state())
        return responses

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

    def _solo_round(self) -> list[BatchResponse]:
        responses = []
        for row in list(self._solo):
            r = next(row.solo)
            responses.append(BatchResponse(row.uid, r.tokens, r.text, r.finish_reason, r.steps))
            if r.finish_reason:
                self._solo.remove(row)
        return responses


def _join(group: _Group, rows: list[_Row], cache, logits: mx.array | None) -> None:
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
