"""Diffusion rows, batched step by step (continuous batching): every row keeps its own cache and
denoises one canvas at a time; the rows whose canvases share a length and a kind of run form a lane
and take one denoising forward per step together, through a view that stacks their prefixes
left-padded (cache.py). A row whose canvas commits emits it and encodes it (with the other rows that
commit at that step and go on) and starts its next canvas at the next step while the others go on,
so no row waits for another's canvas to settle."""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx

from ...model.cache import CanvasView
from ..denoise import new_run, step_batch, step_compacted
from ..request import cut_at_stop
from ..sampler import CanvasRun, RunBatch
from . import Row


@dataclass(eq=False)
class _Canvases:
    """A diffusion row: its cache and the canvas being denoised."""

    row: Row
    cache: object
    clamps: list | None  # a template's (length, Clamp) per canvas
    canvas: int = 0  # canvases committed
    run: CanvasRun | None = None
    gave: int = 0  # tokens the last canvas gave (up to a stop id)


def lane_of(run: CanvasRun) -> tuple[int, float]:
    """Which runs step in one forward: plain runs of one length and one stability threshold (a
    ``RunBatch``), or compacted runs of one length."""
    return (run.length, run.settings.stability_threshold if type(run) is CanvasRun else -1)


@dataclass(eq=False)
class _Lane:
    """Rows of one ``lane_of``: one forward per step, through their views stacked (``view``'s rows are
    ``rows``, in order)."""

    rows: list[_Canvases]
    view: CanvasView
    batch: RunBatch | None = None  # plain runs; None: compacted runs, stepped by step_compacted

    def join(self, state: _Canvases, view: CanvasView) -> None:
        """``state``, whose canvas starts now, with its prefix laid out in ``view``."""
        self.rows.append(state)
        self.view = CanvasView.stack([self.view, view])
        if self.batch is not None:
            self.batch.add([state.run])

    def step(self, model) -> tuple[list[_Canvases], CanvasView, dict[int, Exception]]:
        """One denoising step of every row; those whose canvases committed leave the lane. Returns the
        rows as they were, the view of their prefixes (the commits encode through it) and the rows
        whose own step raised (index -> the error; they left the lane)."""
        rows, before, failed = self.rows, self.view, {}
        if self.batch is not None:
            view = step_batch(model, self.view, self.batch)
            keep = [i for i, state in enumerate(rows) if state.run.result is None]
        else:
            view, keep, failed = step_compacted(model, self.view, [state.run for state in rows])
        self.rows, self.view = [rows[i] for i in keep], view
        return rows, before, failed

    def leave(self, keep: list[int]) -> None:
        self.rows = [self.rows[i] for i in keep]
        if self.batch is not None:
            self.batch.select(keep)
        if keep:
            self.view = self.view.select(keep)


class DiffusionRows:
    """The diffusion rows and their lanes (``lane_of``)."""

    def __init__(self, engine):
        self.engine = engine
        self.rows: list[_Canvases] = []
        self.lanes: dict[tuple[int, float], _Lane] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, row: Row, cache, logits: mx.array | None = None) -> None:
        """The row's next canvas starts at the next step (after ``cache``, which holds everything it emitted)."""
        config = self.engine.model.config
        self.rows.append(_Canvases(row, cache, row.job.canvas_clamps(self.engine.tokenizer, config)))

    def remove(self, uid: int) -> None:
        self.rows = [state for state in self.rows if state.row.uid != uid]
        for key, lane in list(self.lanes.items()):
            keep = [i for i, state in enumerate(lane.rows) if state.row.uid != uid]
            if len(keep) < len(lane.rows):
                lane.leave(keep)
                if not lane.rows:
                    del self.lanes[key]

    def step(self) -> None:
        """A denoising step of every row (a canvas starts where none runs); commits are emitted."""
        for state in list(self.rows):
            if state.run is None:
                try:
                    self._start_canvas(state)
                except Exception as e:  # (a lane takes the run in last, once it is made)
                    self._fail(state, e)
        for key, lane in list(self.lanes.items()):
            rows, view, failed = lane.step(self.engine.model)
            if not lane.rows:
                del self.lanes[key]
            for i, error in failed.items():
                self._fail(rows[i], error)
            if len(lane.rows) + len(failed) < len(rows):
                self._commit(rows, view)

    def _fail(self, state: _Canvases, error: Exception) -> None:
        self.rows.remove(state)
        self.engine.fail(state.row, error)

    def _start_canvas(self, state: _Canvases) -> None:
        row, model = state.row, self.engine.model
        plan, full = row.plan, model.config.canvas_length
        length, clamp = (
            state.clamps[state.canvas] if state.clamps else (plan.last_canvas_length(row.remaining, full), None)
        )
        state.run = new_run(model, plan.settings, row.job.rng, length, clamp, row.on_step)
        view = state.cache.canvas_view(length)
        key = lane_of(state.run)
        if key in self.lanes:
            self.lanes[key].join(state, view)
        else:
            self.lanes[key] = _Lane([state], view, RunBatch([state.run]) if type(state.run) is CanvasRun else None)

    def _commit(self, rows: list[_Canvases], view: CanvasView) -> None:
        """Emit the canvases of ``rows`` (``view``'s rows, in order) that committed at this step; the
        rows that go on encode them, together (their next canvases start at the next step; an auto
        row's next plan starts from the logits after it), finished ones leave."""
        model = self.engine.model
        results = {
            i: state.run.result
            for i, state in enumerate(rows)
            if state.run is not None and state.run.result is not None
        }
        going_on = []
        for i in results:
            try:
                if not self._committed(rows[i]):
                    going_on.append(i)
            except Exception as e:  # this row's own commit: it alone ends
                if rows[i] in self.rows:
                    self._fail(rows[i], e)
        if not going_on:
            return
        hidden = any(rows[i].row.planner is not None for i in going_on)
        if len(going_on) == 1:
            state = rows[going_on[0]]
            out = model.encode(results[going_on[0]].tokens, state.cache, return_hidden=hidden)
            mx.eval(state.cache.state())
        else:
            view = view.select(going_on)
            out = model.encode(mx.concatenate([results[i].tokens for i in going_on]), view, return_hidden=hidden)
            view.append_canvas([rows[i].cache for i in going_on])
            mx.eval([rows[i].cache.state() for i in going_on])
        for j, i in enumerate(going_on):
            state = rows[i]
            if state.row.planner is not None:  # the commit's encode is part of the canvas's cost
                logits = model.head(out[j : j + 1, -1])
                mx.eval(logits)
                self._observe(state, results[i])
                self.rows.remove(state)
                self.engine.replan(state.row)
                self.engine.enter(state.row, state.cache, logits)

    def _committed(self, state: _Canvases) -> bool:
        """Emit the row's committed canvas; returns whether the row is done (it leaves)."""
        row, result, length = state.row, state.run.result, state.run.length
        committed = result.tokens[0].tolist()
        state.run = None
        state.canvas += 1
        row.remaining -= length
        if state.clamps:  # a template's canvases stay whole; it ends with its last one
            tokens, stopped = committed, state.canvas == len(state.clamps)
        else:
            tokens, stopped = cut_at_stop(committed, row.job.stop_ids)
        state.gave = len(tokens)
        last = stopped or row.remaining <= 0
        if last and row.planner is not None:  # said before the answer's end
            self._observe(state, result, encoded=False)
        done = self.engine.emit(row, tokens, result.steps, stopped, last)
        if done:
            self.rows.remove(state)
        return done

    def _observe(self, state: _Canvases, result, encoded: bool = True) -> None:
        row = state.row
        row.planner.observe_canvas(
            row.plan,
            result.steps,
            time.perf_counter() - row.started,
            state.gave,
            row.job.ids,
            alone=self.engine.alone(row),
            encoded=encoded,
        )
