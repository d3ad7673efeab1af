"""A request's events as the worker sends them: one job's until its last, several choices' merged as
they come, each until the client has gone away (looked at while waiting)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.requests import Request

from .scheduler import Event


async def next_event(events: asyncio.Queue, request: Request, poll: float = 0.25) -> Event | None:
    """The request's next event, or None once its client has gone away (looked at while waiting:
    a template's answer sends nothing until its last canvas)."""
    while True:
        try:
            return await asyncio.wait_for(events.get(), timeout=poll)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                return None


async def job_events(events: asyncio.Queue, request: Request) -> AsyncIterator[Event]:
    """The job's events up to its last (a finish or an error), or until its client has gone away."""
    while (event := await next_event(events, request)) is not None:
        yield event
        if event.error is not None or event.finish_reason is not None:
            return


async def choice_events(queues: list[asyncio.Queue], request: Request) -> AsyncIterator[Event]:
    """The events of a request's choices as they come, each marked with its choice (``Event.choice``),
    until every choice has finished, one has failed, or the client has gone away."""
    waiting = {asyncio.ensure_future(events.get()): i for i, events in enumerate(queues)}
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, timeout=0.25, return_when=asyncio.FIRST_COMPLETED)
            if not done and await request.is_disconnected():
                return
            for task in sorted(done, key=waiting.get):
                event = task.result()
                event.choice = waiting.pop(task)
                yield event
                if event.error is not None:
                    return
                if event.finish_reason is None:
                    waiting[asyncio.ensure_future(queues[event.choice].get())] = event.choice
    finally:
        for task in waiting:
            task.cancel()
