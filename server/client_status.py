"""What became of every client of a run: trained, never selected, refused, failed or offline, with its counts; the
end table of `fedge run` and summary.json's `client_status` (so a mean over 6 of 8 clients says what the other 2
did)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from fedge.checkpoint import Tree
from fedge.wire.messages import client_order

TRAINED, NEVER_SELECTED, REFUSED, FAILED, OFFLINE = "trained", "never selected", "refused", "failed", "offline"
FAILED_CODE = "client_failed"  # the reason code of a reply saying the client could not execute its task


@dataclass
class ClientCounts:
    """One client's training tasks sent and replies accepted, tasks left unanswered (training or evaluation), the
    refusals of its replies by reason code, and the last refusal's message."""

    sent: int = 0
    trained: int = 0
    unanswered: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    last_refusal: str = ""

    def status(self) -> tuple[str, str]:
        """(status, reason): trained if any training reply was accepted (the reason then notes any refusals), never
        selected, refused (its most frequent reason code), failed (the client reported an error every time) or
        offline (selected, never replied)."""
        refusals = ", ".join(f"{code} x{n}" for code, n in sorted(self.refused.items()))
        if self.trained:
            reason = f"{self.trained} of {self.sent} training tasks accepted"
            return TRAINED, reason + (f"; refused: {refusals}" if refusals else "")
        if not self.sent:
            return NEVER_SELECTED, "not among the clients sampled in any round"
        if set(self.refused) == {FAILED_CODE}:
            return FAILED, f"{FAILED_CODE} x{self.refused[FAILED_CODE]}: {self.last_refusal}"
        if self.refused:
            return REFUSED, f"{refusals}: {self.last_refusal}"
        return OFFLINE, f"no reply to {self.unanswered} of its tasks"

    def state(self) -> Tree:
        return {
            "sent": self.sent,
            "trained": self.trained,
            "unanswered": self.unanswered,
            "refused": dict(self.refused),
            "last_refusal": self.last_refusal,
        }

    @classmethod
    def from_state(cls, tree: Mapping[str, Any]) -> ClientCounts:
        return cls(
            int(tree["sent"]),
            int(tree["trained"]),
            int(tree["unanswered"]),
            Counter({str(k): int(v) for k, v in tree["refused"].items()}),
            str(tree["last_refusal"]),
        )


class ClientLedger:
    """Every client's ClientCounts, kept by the round loop and checkpointed with it."""

    def __init__(self, clients: Iterable[str]) -> None:
        self.counts = {cid: ClientCounts() for cid in sorted(clients, key=client_order)}

    def sent(self, training: Iterable[str]) -> None:
        for cid in training:
            if cid in self.counts:
                self.counts[cid].sent += 1

    def unanswered(self, clients: Iterable[str]) -> None:
        for cid in clients:
            if cid in self.counts:
                self.counts[cid].unanswered += 1

    def accepted(self, training: Iterable[str]) -> None:
        for cid in training:
            if cid in self.counts:
                self.counts[cid].trained += 1

    def refused(self, cid: str, code: str, message: str) -> None:
        if cid in self.counts:  # a reply from an unknown client is counted by code only
            self.counts[cid].refused[code] += 1
            self.counts[cid].last_refusal = message

    def summary(self, evaluated: Mapping[str, float]) -> dict[str, dict[str, Any]]:
        """summary.json's client_status: client → status, reason, counts, and whether its final accuracy exists."""
        out = {}
        for cid, counts in self.counts.items():
            status, reason = counts.status()
            out[cid] = {"status": status, "reason": reason, "evaluated": cid in evaluated} | counts.state()
        return out

    def state(self) -> Tree:
        return {cid: counts.state() for cid, counts in self.counts.items()}

    def load_state(self, tree: Mapping[str, Any] | None) -> None:
        """Counts from a checkpoint (absent in checkpoints from before them: every count 0)."""
        for cid, counts in (tree or {}).items():
            if cid in self.counts:
                self.counts[cid] = ClientCounts.from_state(counts)
