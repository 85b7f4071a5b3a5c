"""Run a request's coroutine at once, on the caller's stack, and hand it to a Task only if it waits.

An inference usually finishes without waiting for anything (the forward runs on the event loop),
so a Task per request costs its creation and a trip through the loop's ready queue for nothing:
~5-10 µs of a ~150 µs request. Python 3.12's eager task factory does this for every task; this
runtime supports 3.11 and wants it for the request paths only (``fastpath``, ``grpc_h2``).

The coroutine then behaves as under a Task: it runs in a context of its own (a copy of the
caller's), a cancel reaches it wherever it waits (also before the Task's first step), and what
it returns or raises is the Task's result.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine
from typing import Any


def start(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]) -> tuple[bool, Any]:
    """Run ``coro`` until it returns or first waits: (True, what it returned), or (False, the Task
    that carries it on). An exception it raises before waiting is raised here."""
    context = contextvars.copy_context()
    try:
        waiting = context.run(coro.send, None)
    except StopIteration as done:
        return True, done.value
    resumed: list[bool] = []
    task = loop.create_task(_resume(coro, waiting, resumed), context=context)
    task.add_done_callback(lambda t: _cancelled_unresumed(t, coro, waiting, resumed))
    return False, task


async def _resume(coro: Coroutine[Any, Any, Any], waiting: Any, resumed: list[bool]) -> Any:
    """Carry on ``coro``, which suspended yielding ``waiting`` (a future, or None for a bare
    yield), as the Task running it would have: wait for it, resume it, until it returns."""
    resumed.append(True)
    while True:
        try:
            if waiting is None:
                await asyncio.sleep(0)
            else:
                waiting._asyncio_future_blocking = False  # taken, as a Task takes what it is yielded
                await waiting
        except BaseException as exc:  # noqa: BLE001
            # This Task was cancelled (or the wait failed) without the future coro waits on saying
            # so: coro is told. Otherwise coro reads the future's outcome itself when it resumes.
            if waiting is None or not waiting.done() or (
                    isinstance(exc, asyncio.CancelledError) and not waiting.cancelled()):
                try:
                    waiting = coro.throw(exc)
                except StopIteration as done:
                    return done.value
                continue
        try:
            waiting = coro.send(None)
        except StopIteration as done:
            return done.value


def _cancelled_unresumed(task: asyncio.Task[Any], coro: Coroutine[Any, Any, Any], waiting: Any,
                         resumed: list[bool]) -> None:
    """A Task cancelled before its first step never resumed ``coro``: cancel what it waits on and
    tell it, as a Task would have (its ``except CancelledError`` and ``finally`` run now)."""
    if resumed or not task.cancelled():
        return
    if waiting is not None:
        waiting.cancel()
    try:
        coro.throw(asyncio.CancelledError())
    except (StopIteration, asyncio.CancelledError):
        return
    except BaseException:  # noqa: BLE001 - it failed in its cleanup: nobody awaits it to hear
        return
    coro.close()  # it waits again: no Task runs it any more
