"""What the engine-side doors do when the daemon does not answer: a call that finds it away
stops the calls after it for `retry_after` seconds, each answered at once as "not cached" or
"not stored", rather than every call of an engine's thread waiting out the client's reconnect
time (SGLang's prefetch and backup threads, vLLM's lookup thread and scheduler step)."""

from __future__ import annotations

import logging
import time

import kvcached


class Breaker:
    """Whether to ask the daemon now. A failure of kind `trips_on` (by default the daemon
    away) is not asked again for `retry_after` seconds; every failure is logged to `log`,
    counting what failed in `unit`s."""

    def __init__(
        self,
        retry_after: float,
        log: logging.Logger,
        unit: str,
        trips_on: tuple[type[BaseException], ...] = (kvcached.UnreachableError,),
    ) -> None:
        self.retry_after = retry_after
        self.log = log
        self.unit = unit
        self.trips_on = trips_on
        self._down_until = 0.0

    def up(self) -> bool:
        return time.monotonic() >= self._down_until

    def failed(self, what: str, n: int | None, e: Exception) -> None:
        """A call (`what`, of `n` units) failed with `e`."""
        of = f"{what} of {n} {self.unit}" if n is not None else what
        if isinstance(e, self.trips_on):
            self._down_until = time.monotonic() + self.retry_after
            self.log.warning("kvcached is not answering (%s); %s: none, for %.0f s", e, of, self.retry_after)
        else:
            self.log.warning("kvcached: %s failed (%s)", of, e)


def unregister(client: kvcached.Client, log: logging.Logger) -> None:
    """Unregisters `client`'s engine, if it registered one; a failure is only logged (the
    daemon drops an engine whose connection is gone anyway)."""
    if client.engine_id is None:
        return
    try:
        client.unregister()
    except kvcached.KvcachedError as e:
        log.debug("kvcached: unregister failed: %s", e)
