"""eager.start: a coroutine runs at once on the caller's stack, and only one that waits gets a Task
that carries it on exactly as a Task running it from the start would have."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import uvloop

from mnn_runtime import eager

LOOPS = [asyncio.new_event_loop, uvloop.new_event_loop]


def run(factory: Any, main: Any) -> Any:
    loop = factory()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


@pytest.mark.parametrize("factory", LOOPS)
def test_a_coroutine_that_never_waits_finishes_inside_start(factory: Any) -> None:
    steps: list[str] = []

    async def quick() -> int:
        steps.append("ran")
        return 7

    async def main() -> tuple[bool, Any, list[str]]:
        done, value = eager.start(asyncio.get_running_loop(), quick())
        return done, value, list(steps)  # read before the loop turns again

    assert run(factory, main) == (True, 7, ["ran"])


@pytest.mark.parametrize("factory", LOOPS)
def test_an_exception_before_any_wait_is_raised_by_start(factory: Any) -> None:
    async def broken() -> None:
        raise KeyError("boom")

    async def main() -> None:
        with pytest.raises(KeyError):
            eager.start(asyncio.get_running_loop(), broken())

    run(factory, main)


@pytest.mark.parametrize("factory", LOOPS)
def test_a_coroutine_that_waits_is_carried_on_by_a_task_with_its_results_and_errors(factory: Any) -> None:
    async def waits(fail: bool) -> str:
        future = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.01, future.set_result, "value")
        got = await future
        await asyncio.sleep(0)  # a bare yield, then a second future
        await asyncio.sleep(0.01)
        if fail:
            raise ValueError(got)
        return got

    async def main() -> None:
        done, task = eager.start(asyncio.get_running_loop(), waits(False))
        assert not done and isinstance(task, asyncio.Task)
        assert await task == "value"
        done, task = eager.start(asyncio.get_running_loop(), waits(True))
        with pytest.raises(ValueError, match="value"):
            await task

    run(factory, main)


@pytest.mark.parametrize("factory", LOOPS)
def test_cancelling_the_task_cancels_the_coroutine_and_runs_its_cleanup(factory: Any) -> None:
    seen: list[str] = []

    async def slow() -> str:
        try:
            await asyncio.sleep(5)
            return "slept"
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        finally:
            seen.append("cleanup")

    async def main() -> None:
        done, task = eager.start(asyncio.get_running_loop(), slow())
        await asyncio.sleep(0.02)  # the task is waiting on the sleep
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert seen == ["cancelled", "cleanup"]
        seen.clear()
        done, task = eager.start(asyncio.get_running_loop(), slow())
        task.cancel()  # before the task's first step
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)
        assert seen == ["cancelled", "cleanup"]  # told, as a Task tells it: it never slept 5 s

    run(factory, main)


async def _outcome(awaitable: Any) -> str:
    try:
        return f"returned {await awaitable!r}"
    except asyncio.CancelledError:
        return "cancelled"
    except Exception as exc:  # noqa: BLE001
        return f"raised {type(exc).__name__}: {exc}"


@pytest.mark.parametrize("factory", LOOPS)
def test_eager_start_ends_as_a_task_would_in_the_corners_a_review_found(factory: Any) -> None:
    """Each scenario runs under a real Task and under eager.start: same result, same steps seen."""
    import contextvars

    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")

    async def handles_cancel(seen: list[str], loop: Any) -> str:  # cancelled at a bare yield, and returns
        try:
            for _ in range(1000):
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            seen.append("except CancelledError")
            return "handled-cancel"
        return "never cancelled"

    async def awaits(seen: list[str], future: asyncio.Future[str]) -> str:
        try:
            got = await future
            await asyncio.sleep(0)
            return got
        except asyncio.CancelledError:
            seen.append("except CancelledError")
            raise
        finally:
            seen.append("finally")

    async def sets_var(seen: list[str]) -> None:
        var.set("set-by-request")
        await asyncio.sleep(0)

    async def scenario(name: str, eager_: bool) -> tuple[str, list[str], str]:
        loop = asyncio.get_running_loop()
        seen: list[str] = []
        future: asyncio.Future[str] = loop.create_future()
        coro = {"bare-yield cancel handled": lambda: handles_cancel(seen, loop),
                "cancel after the future is done": lambda: awaits(seen, future),
                "cancel before the first step": lambda: awaits(seen, future),
                "context": lambda: sets_var(seen)}[name]()
        task = eager.start(loop, coro)[1] if eager_ else loop.create_task(coro)
        if name == "bare-yield cancel handled":
            for _ in range(3):
                await asyncio.sleep(0)
            task.cancel()
        elif name == "cancel after the future is done":
            await asyncio.sleep(0)
            future.set_result("value")
            task.cancel()
        elif name == "cancel before the first step":  # (eager: the coroutine ran up to its first wait)
            if not eager_:
                await asyncio.sleep(0)  # a Task: its first step runs the coroutine that far
            task.cancel()
        result = await _outcome(task)
        return result, seen, f"future cancelled: {future.cancelled()}, var {var.get()}"

    async def main() -> None:
        for name in ("bare-yield cancel handled", "cancel after the future is done", "cancel before the first step",
                     "context"):
            # each in a Task of its own: a context variable leaking out of one is seen by its result
            loop = asyncio.get_running_loop()
            assert await loop.create_task(scenario(name, True)) == await loop.create_task(scenario(name, False)), name

    run(factory, main)
