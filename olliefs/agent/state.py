"""The agent's state word and the wait for it to change (``statewait``)."""

from __future__ import annotations

import trio


class StateCell:
    """A string value whose changes wake every waiter (no polling)."""

    def __init__(self, value: str = "idle") -> None:
        self.value = value
        # Counts changes, so a waiter sees idle -> thinking -> idle as a change even if it
        # looks only after the state came back (no lost wake-up).
        self.version = 0
        self._lot = trio.lowlevel.ParkingLot()

    def set(self, value: str) -> bool:
        if value == self.value:
            return False
        self.value = value
        self.version += 1
        self._lot.unpark_all()
        return True

    def wake(self) -> None:
        """Wake waiters without a change (used when the session goes away)."""
        self._lot.unpark_all()

    async def wait(self) -> None:
        await self._lot.park()
