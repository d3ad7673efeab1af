"""The worker that owns the model: one thread takes new requests between rounds, makes each ready
(request.plan, from the request the HTTP side resolved), inserts it into the batched engine
(batch.BatchGenerator) with whatever prefix of its prompt the prompt cache holds (the engine encodes
the rest, images included, the fresh prompts of a round in one forward, and hands back a copy for the
prompt cache), runs a round for every active row, and routes the text the engine made of each row's
committed tokens to its request's asyncio queue.

Each request has its own thought-channel decoder, stop strings and text held back (a stop string or a
tool call may be starting); a request whose client went away is removed from the engine before the
next round.
An embedding request (``EmbeddingJob``) is encoded apart from the engine's rows (embeddings.py), a chunk
between rounds, so that generation goes on while it runs.
A request for log-probabilities has a ``scoring.Scorer`` of its own that encodes its prompt and then
its answer's committed tokens (at each event in a stream, else once at the end); one whose
``max_tokens`` is 0 is its prompt scored, nothing generated.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import hashlib
import queue
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..engine.batch import BatchGenerator, StepResponse, warm_up
from ..engine.embeddings import embedding_steps
from ..engine.request import generation_device, plan
from ..engine.resolve import ResolvedRequest
from ..engine.scoring import Scorer, TokenLogprob
from ..errors import OptionError, PromptError, TemplateError
from ..options import PREFILL_STEP_SIZE, GenerationArgs
from ..tokenizer import TextStream
from .prompt_cache import PromptCache
from .stop_strings import StopStrings


class RequestFailed(Exception):
    """A request the worker could not run; ``status`` is the HTTP status to answer with, ``param`` the
    request field at fault (None: none is)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


SHUTTING_DOWN = RequestFailed("the server is shutting down; send the request again once it is back", status=503)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reasoning_tokens: int = 0  # of the completion tokens, the thought's (with thinking on)


@dataclass
class Event:
    """What a request's client gets after a round: new text, the usage so far, and at the end a finish
    reason."""

    content: str = ""
    reasoning: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None  # (None only on an error)
    error: RequestFailed | None = None
    stop_sequence: str | None = None  # the stop string that ended the answer
    choice: int = 0  # which of the request's choices (OpenAI's n) it belongs to
    # With logprobs: those of the tokens committed since the last event (scoring.py), the prompt's on
    # the first event with echo, and at the end what drew the tokens ("encoder", "denoiser" or both).
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    sampled_from: str | None = None


@dataclass
class Job:
    """One request as the worker runs it: what the engine generates (the prompt's ``ids``, the chat
    template applied and any image placeholders expanded, and its options ``args``, resolved) and how
    its text is handed out."""

    ids: list[int]
    args: GenerationArgs
    resolved: ResolvedRequest | None = None  # what the HTTP side settled of it (None: a prompt scored alone)
    stop: list[str] = field(default_factory=list)  # strings that end the answer (not part of it)
    hold: list[str] = field(default_factory=list)  # strings from which on text waits for the end
    whole: bool = False  # the text goes out in one piece at the end (a forced call's arguments)
    tail: str = ""  # text the template's answer ends with that is no part of it (an infill's suffix)
    # The request fields a refusal names: the prompt's (messages or prompt), the template's and the budget's.
    prompt_param: str | None = None
    template_param: str | None = None
    max_tokens_param: str = "max_tokens"
    think: bool = False  # the thought channel is handed out (apart from the answer)
    logprobs: int | None = None  # the answer's log-probabilities, with this many most likely tokens (None: none)
    echo: bool = False  # with logprobs, the prompt's too
    stream: bool = False  # log-probabilities go with every event (else with the last)
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None
    cancelled: bool = False
    # the worker's state
    thought: TextStream | None = None
    text: str = ""  # the engine's text of the answer so far
    stop_strings: StopStrings | None = None  # its stop and held strings, read as it grows
    sent: int = 0
    completion_tokens: int = 0  # tokens committed, padding not counted
    cached_tokens: int | None = None
    scorer: Scorer | None = None
    unscored: list[int] = field(default_factory=list)  # committed tokens the scorer has not taken yet
    prompt_logprobs: list[TokenLogprob] | None = None  # (echo) for the first event
    modes: set[str] = field(default_factory=set)  # the plans' kinds the answer was committed under

    def cancel(self) -> None:
        """The client went away: the worker drops the request before its next round."""
        self.cancelled = True


@dataclass
class EmbeddingJob:
    """Texts to embed (their token ids, none empty): their vectors (float32 [N, hidden_size], in order)
    or an ``Event`` with the error arrive on ``events``."""

    rows: list[list[int]]
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None
    cancelled: bool = False
    steps: Generator[None, None, np.ndarray] | None = None  # the worker's: the encoding under way

    def cancel(self) -> None:
        self.cancelled = True


class Scheduler:
    def __init__(
        self,
        model,
        tokenizer,
        prompt_cache_size: int = 10,
        prefill_step_size: int = PREFILL_STEP_SIZE,
        engine: Callable = BatchGenerator,
        kv_quantization=None,
    ):
        self.model, self.tokenizer, self.prefill_step_size = model, tokenizer, prefill_step_size
        self.prompt_cache = PromptCache(prompt_cache_size)
        self._make_engine = functools.partial(
            engine, prefill_step_size=prefill_step_size, kv_quantization=kv_quantization
        )
        self.engine = self._make_engine(model, tokenizer)
        self._inbox: queue.Queue[Job | None] = queue.Queue()
        self._active: dict[int, Job] = {}
        self._embedding: collections.deque[EmbeddingJob] = collections.deque()  # the first is encoding
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._closed = False
        self.rounds = self.finished = self.cancelled = 0
        # An array a model builds lazily on this thread's stream cannot be evaluated from the worker's
        # (MLX: "There is no Stream(cpu, 0) in current thread"): one small forward here evaluates any.
        warm_up(model, tokenizer)

    # -- the event loop's side ----------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mlx-dgemma-worker", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Fail what is still running (503, "shutting down") and take no more; returns at once."""
        if not self._closed:
            self._closed = True
            self._inbox.put(None)

    def stop(self) -> None:
        """``close``, then wait for the worker to have failed what was running."""
        if self._thread is not None:
            self.close()
            self._stopped.wait()
            self._thread = None

    def submit(self, job: Job | EmbeddingJob) -> asyncio.Queue:
        """Queue ``job``; its events arrive on the returned queue of the running event loop."""
        job.loop, job.events = asyncio.get_running_loop(), asyncio.Queue()
        if self._closed:
            job.events.put_nowait(Event(error=SHUTTING_DOWN))
        else:
            self._inbox.put(job)
        return job.events

    def status(self) -> dict:
        return {
            "active": len(self._active),
            "embedding": len(self._embedding),
            "waiting": self._inbox.qsize(),
            "rounds": self.rounds,
            "finished": self.finished,
            "cancelled": self.cancelled,
            "prompt_cache": len(self.prompt_cache),
        }

    # -- the worker's side ---------------------------------------------------------------------------

    def _run(self) -> None:
        mx.set_default_stream(mx.new_stream(mx.default_device()))  # MLX streams belong to a thread
        with generation_device(self.model):
            self._serve()

    def _serve(self) -> None:
        while True:
            new: list[Job | EmbeddingJob | None] = []
            try:  # wait while idle; between rounds, take whatever has arrived
                new.append(self._inbox.get(block=not self._active and not self._embedding))
                while True:
                    new.append(self._inbox.get_nowait())
            except queue.Empty:
                pass
            if None in new:
                for job in [*self._active.values(), *self._embedding, *(j for j in new if j is not None)]:
                    self._send(job, Event(error=SHUTTING_DOWN))
                self._active.clear()
                self._embedding.clear()
                self._stopped.set()
                # MLX 0.32 aborts the process at exit once a thread that ran attention on the CPU has
                # ended; the worker stays, failing whatever still comes (a daemon thread, it ends with
                # the process).
                while True:
                    if (job := self._inbox.get()) is not None:
                        self._send(job, Event(error=SHUTTING_DOWN))
            for job in new:
                if isinstance(job, EmbeddingJob):
                    self._embedding.append(job)
                else:
                    self._start(job)
            for uid, job in list(self._active.items()):
                if job.cancelled:
                    self.engine.remove(uid)
                    del self._active[uid]
                    self.cancelled += 1
            self._embed()
            if not self._active:
                continue
            try:
                responses = self.engine.next()
            except Exception as e:  # a shared forward failed (no one row's): the engine is in an unknown state
                for job in self._active.values():
                    self._send(job, Event(error=RequestFailed(f"generation failed: {one_line(e)}", status=500)))
                self._active.clear()
                self.engine = self._make_engine(self.model, self.tokenizer)
                continue
            self.rounds += 1
            for response in responses:
                job = self._active.get(response.uid)
                try:
                    if response.error is not None:  # the engine ended this row alone
                        raise response.error
                    self._route(response)
                except Exception as e:  # this request's answer could not be made; the others go on
                    if self._active.pop(response.uid, None) is not None and response.finish_reason is None:
                        self.engine.remove(response.uid)  # (a no-op for a row already gone)
                    if job is not None:
                        self._send(job, Event(error=failure(job, e)))

    def _start(self, job: Job) -> None:
        """Make ``job`` ready (request.plan) and insert its row with the prefix of its prompt the
        prompt cache holds; the engine encodes the rest and hands it back for the prompt cache."""
        if job.cancelled:
            self.cancelled += 1
            return
        try:
            if job.args.max_tokens == 0:  # the prompt alone, scored
                self._score_prompt(job, job.ids)
                job.scorer = None
                self.finished += 1
                self._send(
                    job,
                    Event(finish_reason="length", usage=Usage(len(job.ids), 0, 0), prompt_logprobs=job.prompt_logprobs),
                )
                return
            prepared = plan(self.model, self.tokenizer, job.resolved)
            key = _cache_key(prepared.ids, prepared.vision_inputs, self.model.config.image_token_id)
            cache, cached = self.prompt_cache.fetch(key)
            # The prompt cache keeps all but the last id (a later prompt needs a new position to start from).
            end = len(key) - 1
            keep = (
                functools.partial(self.prompt_cache.insert, key[:end])
                if end > cached and self.prompt_cache.max_size
                else None
            )
            job.cached_tokens = cached
            # With thinking on, the thought channel of a free answer or a text template; a JSON one has none.
            job.thought = (
                TextStream(self.tokenizer, prepared.stop_ids, thought=True)
                if job.think and not job.resolved.layout.json
                else None
            )
            job.stop_strings = StopStrings(job.stop, job.hold)
            self._score_prompt(job, prepared.ids, prepared.vision_inputs)
            uid = self.engine.insert(prepared, cache, keep)
        except Exception as e:  # (request.plan refuses what the device cannot run with a ValueError)
            self._send(job, Event(error=failure(job, e, bad_input=ValueError)))
            return
        self._active[uid] = job

    def _embed(self) -> None:
        """One chunk of the oldest embedding request; at its end, its vectors go to its client."""
        while self._embedding and self._embedding[0].cancelled:
            self._embedding.popleft()
            self.cancelled += 1
        if not self._embedding:
            return
        job = self._embedding[0]
        try:
            if job.steps is None:
                job.steps = embedding_steps(self.model, job.rows, self.tokenizer.bos_token_id, self.prefill_step_size)
            next(job.steps)
        except StopIteration as done:
            self._embedding.popleft()
            self.finished += 1
            self._send(job, done.value)
        except Exception as e:  # this request's forward failed; its cache was its own, generation goes on
            self._embedding.popleft()
            self._send(job, Event(error=RequestFailed(f"embedding failed: {one_line(e)}", status=500)))

    def _score_prompt(self, job: Job, ids: list[int], vision_inputs: dict | None = None) -> None:
        """With logprobs, a scorer for the job's answer that has encoded the prompt (the prompt's
        log-probabilities kept for its first event, with echo)."""
        if job.logprobs is None:
            return
        job.scorer, job.unscored, job.modes = Scorer(self.model, job.logprobs, self.prefill_step_size), [], set()
        scored = job.scorer.add(ids, **(vision_inputs or {}))
        job.prompt_logprobs = scored if job.echo else None

    def _route(self, response: StepResponse) -> None:
        job = self._active.get(response.uid)
        if job is None:
            return
        tokens, finish = response.tokens, response.finish_reason  # (the engine cuts them at max_tokens)
        pad = self.tokenizer.pad_token_id
        job.completion_tokens += sum(t != pad for t in tokens)
        if job.scorer is not None:
            job.unscored += tokens
            if response.plan is not None:
                job.modes.add(response.plan.mode)
        if finish == "length" and tokens and tokens[-1] == pad:
            # The text ended before the limit (padding is no part of the answer, nor of its usage): the
            # client is told the answer is whole, not cut.
            finish = "stop"
        job.text += response.text
        if finish is not None and job.tail and job.text.endswith(job.tail):
            job.text = job.text[: -len(job.tail)]
        reasoning = job.thought.add(tokens, final=finish is not None) if job.thought else ""
        stop_sequence = None
        if (found := job.stop_strings.read(job.text)) is not None:
            cut, stop_sequence = found
            job.text, finish = job.text[:cut], "stop"
        if finish is not None:
            del self._active[response.uid]
            if response.finish_reason is None:  # the engine would go on: the row ends here
                self.engine.remove(response.uid)
        end = len(job.text) if finish else 0 if job.whole else job.stop_strings.sendable()
        usage = Usage(len(job.ids), job.completion_tokens, job.cached_tokens or 0)
        event = Event(job.text[job.sent : end], reasoning, finish, usage, stop_sequence=stop_sequence)
        if job.scorer is not None and (job.stream or finish is not None):
            event.logprobs, job.unscored = job.scorer.add(job.unscored), []
            event.prompt_logprobs, job.prompt_logprobs = job.prompt_logprobs, None
            if finish is not None:
                event.sampled_from = sampled_from(job.modes)
                job.scorer = None  # its KV cache, the answer's length, is let go now, not with the reply
        job.sent = max(job.sent, end)
        if finish is not None and job.thought is not None:
            usage.reasoning_tokens = self.tokenizer.thought_tokens(job.thought.tokens, job.thought.stop_ids)
        self.finished += finish is not None
        self._send(job, event)

    def _send(self, job: Job | EmbeddingJob, event: Event | np.ndarray) -> None:
        try:
            job.loop.call_soon_threadsafe(job.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass


def failure(
    job: Job, e: Exception, bad_input: type | tuple[type, ...] = (TemplateError, PromptError, OptionError)
) -> RequestFailed:
    """What the client of ``job`` is told of ``e``: a prompt, template (a schema's grammar included)
    or setting the model cannot take (``bad_input``) is a 400 naming the request's field (the option
    the error names, else the template's or the prompt's); anything else is a 500."""
    if isinstance(e, bad_input):
        option = getattr(e, "option", None)
        param = (job.max_tokens_param if option == "max_tokens" else option) or (
            job.template_param
            if isinstance(e, TemplateError)
            else job.prompt_param
            if isinstance(e, PromptError)
            else None
        )
        return RequestFailed(one_line(e), param=param)
    return RequestFailed(f"generation failed: {one_line(e)}", status=500)


def sampled_from(modes: set[str]) -> str:
    """What drew an answer's tokens, by the kinds of plan they were committed under: the encoder
    (autoregressive decoding, and verified drafting, whose exact sampling keeps its distribution),
    the denoiser (diffusion canvases), or both (auto moving between them)."""
    drawers = {"denoiser" if mode == "diffusion" else "encoder" for mode in modes}
    return " and ".join(sorted(drawers, reverse=True)) or "encoder"


def one_line(e: Exception) -> str:
    """``e``'s message as an error shows it: its first line, cut short."""
    lines = str(e).strip().splitlines() or [type(e).__name__]
    return lines[0] if len(lines[0]) <= 300 else lines[0][:297] + "..."


def _cache_key(ids: list[int], vision_inputs: dict, image_token_id: int | None) -> list:
    """The prompt cache's key: the ids, with each image's tokens standing for a hash of its pixels (the
    same ids with another picture are another prompt; the text before an image still matches)."""
    if not vision_inputs:
        return ids
    pixels, positions = vision_inputs["pixel_values"], vision_inputs["image_position_ids"]
    digests = iter(
        [
            hashlib.sha256(np.asarray(p).tobytes() + np.asarray(q).tobytes()).hexdigest()
            for p, q in zip(pixels, positions)
        ]
    )
    key, digest = [], None
    for i, token in enumerate(ids):
        if token == image_token_id and (i == 0 or ids[i - 1] != image_token_id):
            digest = next(digests)
        key.append(digest if token == image_token_id else token)
    return key
