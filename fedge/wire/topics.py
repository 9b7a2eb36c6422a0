"""MQTT topic names, in one place: everything of a run lives under fedge/<run>/.

Clients write register/<id>, result/<id> and status/<id>, and read task/<id> and the server's status
topic; the broker's ACLs (fedge/brokers/access.py) and the server's identity check enforce that the <id>
level is the sender's own.
"""

from __future__ import annotations

import re

from fedge.constants import TOPIC_ROOT
from fedge.errors import UserError

ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
UPLINK = ("register", "result", "status")  # client → server, one topic per client
DOWNLINK = "task"  # server → client (tasks and acknowledgements)
SERVER = "server"  # the server's own status broadcast
SERVER_ID = "server"  # the sender every server envelope names (its messages' identity, not an MQTT username)


class TopicError(UserError, ValueError):
    """A topic or identifier that fedge does not use; says which part is wrong."""


def check_id(value: str, what: str) -> str:
    """A run or client id must be a plain topic level: 1–64 letters, digits, _ or -."""
    if not isinstance(value, str) or not ID_PATTERN.fullmatch(value):
        raise TopicError(f"{what} {value!r} must be 1-64 letters, digits, '_' or '-'")
    return value


def client_topic(run: str, kind: str, client: str) -> str:
    """fedge/<run>/<kind>/<client> for kind in register, result, status, task."""
    if kind not in (*UPLINK, DOWNLINK):
        raise TopicError(f"unknown topic kind {kind!r}")
    return f"{TOPIC_ROOT}/{check_id(run, 'run id')}/{kind}/{check_id(client, 'client id')}"


def server_topic(run: str) -> str:
    """fedge/<run>/server: the server announces itself (online/offline) here."""
    return f"{TOPIC_ROOT}/{check_id(run, 'run id')}/{SERVER}"


def uplink_filters(run: str) -> list[str]:
    """What the server subscribes to: every client's register, result and status topics."""
    return [f"{TOPIC_ROOT}/{check_id(run, 'run id')}/{kind}/+" for kind in UPLINK]


def parse(topic: str) -> tuple[str, str, str | None]:
    """(run, kind, client or None for the server topic); anything else raises TopicError."""
    parts = topic.split("/")
    if len(parts) == 3 and parts[0] == TOPIC_ROOT and parts[2] == SERVER and ID_PATTERN.fullmatch(parts[1]):
        return parts[1], SERVER, None
    if (
        len(parts) != 4
        or parts[0] != TOPIC_ROOT
        or parts[2] not in (*UPLINK, DOWNLINK)
        or not ID_PATTERN.fullmatch(parts[1])
        or not ID_PATTERN.fullmatch(parts[3])
    ):
        raise TopicError(f"topic {topic!r} is not a fedge topic")
    return parts[1], parts[2], parts[3]
