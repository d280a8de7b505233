"""What pyfuse3's worker loop (.ci/pyfuse3/loop.patch) assumes of trio's scheduler.

The loop answers requests in place, in one task, and must still let the next request see
what the last one changed: the tasks that a request woke (a prompt's submission wakes
its session's runner) must have run before the next request is served. It passes two
checkpoints for that, on the ground that trio runs the tasks that are runnable in
batches, each batch in an order that is the queue's or its reverse, and that a task that
passes a checkpoint goes to the next batch: whatever was runnable when the first
checkpoint began has run by the time the second one returns. pyproject.toml pins trio to
the versions this was tested with; these tests check it on the trio installed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing

ROUNDS = 200  # each round's batch order is a coin toss: both orders come up
WAITERS = 8

Checkpoint = Callable[[], Awaitable[None]]
CHECKPOINTS = [trio.lowlevel.checkpoint, trio.lowlevel.cancel_shielded_checkpoint]


async def _waiter(lot: trio.lowlevel.ParkingLot, ran: list[int], i: int) -> None:
    await lot.park()
    ran.append(i)


async def _round(checkpoint: Checkpoint, passes: int, by_another_task: bool) -> bool:
    """Wake WAITERS parked tasks, pass ``passes`` checkpoints: have they all run?"""
    ran: list[int] = []
    lot = trio.lowlevel.ParkingLot()
    async with trio.open_nursery() as nursery:
        for i in range(WAITERS):
            nursery.start_soon(_waiter, lot, ran, i)
        await trio.testing.wait_all_tasks_blocked()
        if by_another_task:
            # A handler that had suspended ends in its own worker, waking tasks, and the
            # reader goes on after it (the loop's ``woke`` case).
            handler_done = trio.Event()

            async def handler() -> None:
                lot.unpark_all()
                handler_done.set()

            nursery.start_soon(handler)
            await handler_done.wait()
        else:
            lot.unpark_all()  # a request answered in place woke them
        for _ in range(passes):
            await checkpoint()
        all_ran = len(ran) == WAITERS
    return all_ran


@pytest.mark.parametrize("by_another_task", [False, True], ids=["in-place", "handler"])
@pytest.mark.parametrize("checkpoint", CHECKPOINTS, ids=lambda c: c.__name__)
async def test_two_checkpoints_let_every_woken_task_run(
    checkpoint: Checkpoint, by_another_task: bool
) -> None:
    for _ in range(ROUNDS):
        assert await _round(checkpoint, 2, by_another_task)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS, ids=lambda c: c.__name__)
async def test_one_checkpoint_is_not_always_enough(checkpoint: Checkpoint) -> None:
    """Why two: in about half the rounds the reader runs first in the next batch."""
    results = [await _round(checkpoint, 1, False) for _ in range(ROUNDS)]
    assert not all(results)
