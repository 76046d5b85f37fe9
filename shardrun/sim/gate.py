"""A capacity gate with strict FIFO waiters: what makes the simulator queue like a busy server."""

from __future__ import annotations

import asyncio
from collections import deque


class FifoGate:
    """At most `capacity` holders (0 = unlimited); waiters are served strictly in arrival order."""

    def __init__(self, capacity: int) -> None:
        self._capacity, self._busy = capacity, 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    def try_acquire(self) -> bool:
        """Take a slot now if one is free and nobody is waiting ahead."""
        if self._capacity == 0 or (self._busy < self._capacity and not self._waiters):
            self._busy += 1
            return True
        return False

    async def wait(self) -> None:
        """Queue for a slot; a cancelled waiter hands back a slot it was just given."""
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()
            else:
                self._waiters.remove(fut)
            raise

    def release(self) -> None:
        """Give the slot to the oldest live waiter, or free it."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot passes on; _busy is unchanged
                return
        self._busy -= 1
