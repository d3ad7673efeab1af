"""A stand-in for the batched engine: the ``BatchGenerator`` interface served one request at a time.

The scheduler drives an engine through ``insert`` / ``next`` / ``remove``. This one runs the oldest
request's ``stream_generate`` one committed canvas per ``next()`` and the others wait their turn (in
order, so none starves); the batched engine puts every active row through each round together.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..generate import GenerationResponse, stream_generate
from ..template import CanvasTemplate


@dataclass
class BatchRequest:
    prompt_ids: list[int]
    max_tokens: int
    seed: int | None = None
    policy: str = "reference"
    steps: int | None = None
    temp_min: float | None = None
    temp_max: float | None = None
    template: CanvasTemplate | None = None
    stop: list[list[int]] | None = None
    # A KV cache (model.make_cache()) already holding prompt_ids[:cache.offset]: a prefix from the
    # prompt cache, or one the scheduler prefilled; the engine encodes only the rest.
    cache: Any = None


@dataclass
class BatchResponse:
    uid: int
    tokens: list[int]  # committed in this round, cut at a stop id and at max_tokens
    finish_reason: str | None  # "stop", "length", or None while the request goes on
    steps: int  # forwards this round took for the request


class SequentialBatchGenerator:
    """One request at a time on ``stream_generate``: ``next()`` commits one canvas of the oldest."""

    def __init__(self, model, tokenizer, prefill_step_size: int = 2048):
        self.model, self.tokenizer = model, tokenizer
        self.prefill_step_size = prefill_step_size  # the scheduler prefills; kept for the interface
        self._uids = itertools.count()
        self._rows: dict[int, tuple[BatchRequest, Iterator[GenerationResponse] | None, int]] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def insert(self, request: BatchRequest) -> int:
        if request.stop:
            raise ValueError("token stop sequences are not supported by the sequential engine")
        uid = next(self._uids)
        self._rows[uid] = (request, None, 0)
        return uid

    def remove(self, uid: int) -> None:
        request, responses, _ = self._rows.pop(uid)
        if responses is not None:
            responses.close()

    def next(self) -> list[BatchResponse]:
        if not self._rows:
            return []
        uid = next(iter(self._rows))
        request, responses, produced = self._rows[uid]
        if responses is None:  # prefill happens lazily, on the request's first round
            responses = stream_generate(
                self.model, self.tokenizer, request.prompt_ids, request.max_tokens, seed=request.seed,
                policy=request.policy, steps=request.steps, temp_min=request.temp_min, temp_max=request.temp_max,
                template=request.template, cache=request.cache)
        response = next(responses)
        tokens, finish = response.tokens, response.finish_reason
        room = request.max_tokens - produced  # canvases round max_tokens up; an answer does not
        if request.template is None and len(tokens) >= room and not (finish == "stop" and len(tokens) <= room):
            tokens, finish = tokens[:room], "length"
        if finish is None:
            self._rows[uid] = (request, responses, produced + len(tokens))
        else:
            del self._rows[uid]
            responses.close()
        return [BatchResponse(uid, tokens, finish, response.steps)]
