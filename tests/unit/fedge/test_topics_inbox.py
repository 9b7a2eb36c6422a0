"""Topic names and the inbox's checks on arriving frames (no broker needed: the inbox is pure)."""

import os
from collections import Counter

import pytest

from fedge.brokers.mqtt import Inbox, MqttError, first_address, parse_broker
from fedge.wire import topics
from fedge.wire.chunks import frames
from fedge.wire.envelope import Envelope, WireError

pytestmark = pytest.mark.timeout(60)


def test_topics_round_trip_and_reject_wildcards():
    t = topics.client_topic("run1", "result", "7")
    assert t == "fedge/run1/result/7" and topics.parse(t) == ("run1", "result", "7")
    assert topics.parse(topics.server_topic("run1")) == ("run1", "server", None)
    for bad in ("fedge/run1/result/+", "fedge/run1/result/a/b", "other/run1/task/a", "fedge/run1/weird/a"):
        with pytest.raises(topics.TopicError):
            topics.parse(bad)
    with pytest.raises(topics.TopicError):
        topics.client_topic("run1", "task", "a/b")
    with pytest.raises(topics.TopicError):
        topics.client_topic("run#", "task", "a")


def test_broker_url_parsing_hides_the_password():
    b = parse_broker("mqtt://alice:s3cret@10.0.0.2:1884")
    assert (b.host, b.port, b.tls, b.username, b.password) == ("10.0.0.2", 1884, False, "alice", "s3cret")
    assert "s3cret" not in str(b) and "s3cret" not in repr(b)
    assert parse_broker("mqtts://h").port == 8883
    assert parse_broker("mqtt://h", username="bob", password="pw").username == "bob"


def test_a_broker_url_list_names_the_nodes_of_one_cluster():
    b = parse_broker("mqtt://alice:s3cret@n1:1884, n2 ,mqtt://n3:1885")
    assert b.addresses == (("n1", 1884), ("n2", 1883), ("n3", 1885)) and (b.username, b.password) == ("alice", "s3cret")
    assert str(b) == "mqtt://alice@n1:1884,mqtt://alice@n2:1883,mqtt://alice@n3:1885"
    assert parse_broker("mqtts://n1,n2").addresses == (("n1", 8883), ("n2", 8883))
    with pytest.raises(MqttError, match="mix"):
        parse_broker("mqtts://n1,mqtt://n2")
    with pytest.raises(MqttError, match="must look like"):
        parse_broker("mqtt://n1,")
    spread = Counter(first_address(parse_broker("n1,n2,n3"), str(i)) for i in range(300))
    assert set(spread) == {0, 1, 2} and min(spread.values()) > 60  # a fleet given one list spreads over it


def _frames(run="r", type="result", sender="a", payload=b"x" * 100, rnd=2, reply_to="1" * 32, chunk=40):
    env = Envelope.new(run, rnd, type, sender, payload, reply_to=reply_to, chunk_size=chunk)
    return env, frames(env, payload, chunk)


def _inbox(limit=10_000):
    seen = []

    def accept(kind, client, env):
        seen.append((kind, client, env.msg_id))
        return limit

    return Inbox("r", accept), seen


def test_inbox_joins_chunks_once_and_counts_nothing_when_clean():
    inbox, seen = _inbox()
    env, parts = _frames()
    out = [inbox.receive("fedge/r/result/a", p) for p in parts[::-1] + parts]
    done = [d for d in out if d is not None]
    assert len(done) == 1 and done[0].payload == b"x" * 100 and done[0].client == "a"
    assert not inbox.rejected and inbox.joiner.duplicates == len(parts)


@pytest.mark.parametrize(
    "topic, kwargs, reason",
    [
        ("fedge/r/result/b", {}, "spoof"),  # a's envelope on b's topic
        ("fedge/other/result/a", {}, "wrong_run"),
        ("fedge/r/result/a", {"run": "other"}, "wrong_run"),
        ("fedge/r/register/a", {}, "bad_format"),  # a result on the register topic
        ("fedge/r/task/a", {}, "spoof"),  # downlink messages must come from the server
    ],
)
def test_inbox_rejections(topic, kwargs, reason):
    inbox, seen = _inbox()
    _, parts = _frames(**kwargs)
    assert inbox.receive(topic, parts[0]) is None
    assert inbox.rejected == {reason: 1} and not seen  # rejected before the per-kind checks


def test_inbox_size_cap_checked_before_any_chunk_is_kept():
    inbox, seen = _inbox(limit=50)
    _, parts = _frames()
    assert inbox.receive("fedge/r/result/a", parts[0]) is None
    assert inbox.rejected == {"too_large": 1} and inbox.joiner.pending == 0


def test_inbox_expired_and_accept_refusal():
    inbox, _ = _inbox()
    payload = os.urandom(10)
    env = Envelope.new("r", 0, "result", "a", payload, ttl_s=1e-9)
    assert inbox.receive("fedge/r/result/a", frames(env, payload)[0]) is None
    assert inbox.rejected == {"expired": 1}

    def refuse(kind, client, env):
        raise WireError("stale_round", "old")

    inbox = Inbox("r", refuse)
    _, parts = _frames()
    assert inbox.receive("fedge/r/result/a", parts[0]) is None and inbox.rejected == {"stale_round": 1}
