"""The transport interface the round loop talks to, and the in-process transport for simulation."""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Protocol

from fedge.wire.messages import Result, Task

log = logging.getLogger(__name__)
Handler = Callable[[Task], Result]


class Transport(Protocol):
    """Delivers tasks to clients and returns the replies that arrived (a missing client is simply absent)."""

    def exchange(self, tasks: Mapping[str, Task], limits: Mapping[str, int]) -> dict[str, Result]:
        """Send each client its task and return the replies that arrived; `limits` bounds each client's reply
        payload in bytes (from what the strategy expects for that task), enforced where bytes arrive."""
        ...

    def report(self) -> dict[str, Any]:
        """Summary fields about the transport: what it was and what it rejected."""
        ...


class InProcTransport:
    """Calls each client's handler directly, one after another, in this process.

    A handler that raises is logged and answers with a failed Result (its `error` says why), as the MQTT edge
    client does.
    """

    def __init__(self, handlers: Mapping[str, Handler]) -> None:
        self.handlers = dict(handlers)

    def exchange(self, tasks: Mapping[str, Task], limits: Mapping[str, int] | None = None) -> dict[str, Result]:
        """Each handler's reply; `limits` is not needed in one process (replies are objects, not bytes)."""
        results = {}
        for cid, task in tasks.items():
            if cid not in self.handlers:
                log.warning("no client %s registered; task %s dropped", cid, task.type)
                continue
            try:
                results[cid] = self.handlers[cid](task)
            except Exception as e:  # a crashing client is a failed reply, not a crashed server
                log.exception("client %s failed on task %s of round %d", cid, task.type, task.round)
                results[cid] = Result(cid, task.round, task.type, 0, error=f"{type(e).__name__}: {e}")
        return results

    def report(self) -> dict[str, Any]:
        return {"transport": {"kind": "inproc"}, "rejected_messages": {}}
