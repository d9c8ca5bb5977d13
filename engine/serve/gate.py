"""`GenerationGate`: one generation at a time, served in arrival order.

The gate is the queue in front of the engine: a first-come, first-served lock whose waiters may give up
(a client that hung up while queued) and whose length can be capped. The worker's chat jobs and the
API's requests share one gate, so they queue together. A holder is exclusive (a chat job, a load, a
generation on an engine without batching) or shared (generations on a batching engine, which run side by
side in its batch); shared holders enter together, but none passes an exclusive one queued before it.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class GateClosed(Exception):
    """The gate was closed (the server is stopping) while waiting."""


class GateAbandoned(Exception):
    """The waiter gave up (its `abandon` callback returned True)."""


class GenerationGate:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: collections.deque[object] = collections.deque()
        self._held = False         # an exclusive holder
        self._shared = 0           # shared holders

    @property
    def waiting(self) -> int:
        """How many are queued (not counting the holder)."""
        with self._cond:
            return len(self._queue)

    @property
    def busy(self) -> bool:
        return self._held or self._shared > 0

    def acquire(self, abandon: Callable[[], bool] | None = None, closed: Callable[[], bool] | None = None,
                poll_s: float = 0.2, shared: bool = False) -> None:
        """Wait for the turn. `abandon()` / `closed()` are polled while waiting: True gives up with
        `GateAbandoned` / `GateClosed`. `shared`: enter beside other shared holders."""
        ticket = object()
        with self._cond:
            self._queue.append(ticket)
            try:
                while self._held or self._queue[0] is not ticket or (self._shared and not shared):
                    if closed is not None and closed():
                        raise GateClosed()
                    if abandon is not None and abandon():
                        raise GateAbandoned()
                    self._cond.wait(poll_s if (abandon or closed) else None)
                self._queue.popleft()
                if shared:
                    self._shared += 1
                    self._cond.notify_all()        # the next shared waiter may enter too
                else:
                    self._held = True
            except BaseException:
                if ticket in self._queue:
                    self._queue.remove(ticket)
                self._cond.notify_all()
                raise

    def release(self, shared: bool = False) -> None:
        with self._cond:
            if shared:
                self._shared -= 1
            else:
                self._held = False
            self._cond.notify_all()

    @contextmanager
    def hold(self, abandon: Callable[[], bool] | None = None,
             closed: Callable[[], bool] | None = None) -> Iterator[None]:
        self.acquire(abandon, closed)
        try:
            yield
        finally:
            self.release()
