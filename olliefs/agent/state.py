"""The agent's state word and the wait for it to change (``statewait``)."""

from __future__ import annotations

import trio


class StateCell:
    """A string value whose changes wake every waiter (no polling)."""

    def __init__(self, value: str = "idle") -> None:
        self.value = value
        self._lot = trio.lowlevel.ParkingLot()

    def set(self, value: str) -> bool:
        if value == self.value:
            return False
        self.value = value
        self._lot.unpark_all()
        return True

    def wake(self) -> None:
        """Wake waiters without a change (used when the session goes away)."""
        self._lot.unpark_all()

    async def wait(self) -> None:
        await self._lot.park()
