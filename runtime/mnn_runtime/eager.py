"""Run a request's coroutine at once, on the caller's stack, and hand it to a Task only if it waits.

An inference usually finishes without waiting for anything (the forward runs on the event loop),
so a Task per request costs its creation and a trip through the loop's ready queue for nothing:
~5-10 µs of a ~150 µs request. Python 3.12's eager task factory does this for every task; this
runtime supports 3.11 and wants it for the request paths only (``fastpath``, ``grpc_h2``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


def start(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]) -> tuple[bool, Any]:
    """Run ``coro`` until it returns or first waits: (True, what it returned), or (False, the Task
    that carries it on). An exception it raises before waiting is raised here."""
    try:
        waiting = coro.send(None)
    except StopIteration as done:
        return True, done.value
    # (a Task cancelled before its first step never resumes coro: coro is closed, its cleanup run,
    # when the Task lets go of it)
    return False, loop.create_task(_resume(coro, waiting))


async def _resume(coro: Coroutine[Any, Any, Any], waiting: Any) -> Any:
    """Carry on ``coro``, which suspended yielding ``waiting`` (a future, or None for a bare
    yield), as the Task running it would have: wait for it, resume it, until it returns."""
    while True:
        try:
            if waiting is None:
                await asyncio.sleep(0)
            else:
                waiting._asyncio_future_blocking = False  # taken, as a Task takes what it is yielded
                await waiting
        except BaseException as exc:  # noqa: BLE001
            if waiting is None or not waiting.done():  # this Task was cancelled: so is coro
                waiting = coro.throw(exc)
                continue
            # else coro reads the future's outcome (its exception) itself when it resumes
        try:
            waiting = coro.send(None)
        except StopIteration as done:
            return done.value
