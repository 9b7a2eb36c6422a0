"""The Fleet's protocol with real EdgeClients over an in-memory link: registration, replies, the deadline,
offline clients, results that answer nothing, takeovers. Real brokers: tests/integration, tests/fault."""

import pytest

import server.fleet
from edge_client.session import ClientStopped
from fedge.wire.messages import Task
from server.fleet import reply_limit

from helpers.fake_link import WAIT_S, FakeFederation, wait_until

pytestmark = pytest.mark.timeout(60)


def test_a_registration_is_recorded_with_its_reply_limit_and_acknowledged():
    with FakeFederation() as fed:
        agent = fed.client("0").client.agent
        info = agent.info()
        assert fed.fleet.wait_for_clients(1, WAIT_S) == {"0": info}
        assert fed.fleet.limits == {"0": reply_limit(info)}
        assert fed.net.count("ack", fed.task_topic("0")) == 1
        assert fed.fleet.inbox.rejected == {}


def test_an_exchange_returns_every_reply_and_acknowledges_each():
    with FakeFederation() as fed:
        fed.client("0"), fed.client("1")
        results = fed.fleet.exchange({"0": Task("train", 1), "1": Task("evaluate", 1)})
        assert {cid: (r.round, r.type) for cid, r in results.items()} == {"0": (1, "train"), "1": (1, "evaluate")}
        wait_until(lambda: fed.net.count("ack") == 4, "both results to be acknowledged")
        assert [fed.net.count("ack", fed.task_topic(cid)) for cid in "01"] == [2, 2]  # registration, result
        assert fed.fleet.counts == {}


def test_the_deadline_ends_a_round_without_the_silent_client():
    with FakeFederation(deadline_s=0.2) as fed:
        fed.client("0").client.agent.go.clear()  # alive, but never answers before the deadline
        assert fed.fleet.exchange({"0": Task("train", 1)}) == {}
        assert fed.fleet.counts == {"deadline_missed": 1}


def test_a_result_answering_no_open_instruction_is_rejected_with_its_reason():
    with FakeFederation(deadline_s=0.2) as fed:
        late = fed.client("0")
        late.client.agent.go.clear()
        assert fed.fleet.exchange({"0": Task("train", 1)}) == {}  # the deadline closed the instruction
        late.client.agent.go.set()
        wait_until(lambda: fed.fleet.inbox.rejected and late.client.pending, "the late result to be sent")
        assert fed.fleet.inbox.rejected == {"no_open_task": 1}
        assert fed.fleet.results == {} and fed.net.count("ack") == 1  # only the registration's


def test_a_client_gone_offline_is_not_waited_for(monkeypatch):
    monkeypatch.setattr(server.fleet, "RECONNECT_GRACE_S", 0.0)  # no time to come back
    with FakeFederation() as fed:
        gone = fed.client("0")
        fed.client("1")
        gone.client.link.crash()  # the broker publishes its will
        assert fed.fleet.offline == {"0"} and not fed.fleet.alive("0") and fed.fleet.alive("1")
        results = fed.fleet.exchange({"0": Task("train", 1), "1": Task("train", 1)})
        assert list(results) == ["1"]
        assert fed.fleet.counts == {}  # ended by the replies, not by the deadline


def test_a_replaced_session_speaking_again_is_counted_and_told_to_stop():
    with FakeFederation() as fed:
        older = fed.client("0")
        newer = fed.client("0")  # a second process with the same client id: its session replaces the first
        older.client._status("alive")  # the older one's heartbeat: two connections take turns
        assert fed.fleet.takeovers == {"0": 1}
        wait_until(older.done, "the older connection to stop")
        assert isinstance(older.error, ClientStopped) and "took over" in str(older.error)
        assert fed.fleet.sessions["0"] == newer.client.session
        # the stop named the older session only: the newer one handled it, then this task
        assert list(fed.fleet.exchange({"0": Task("train", 1)})) == ["0"]
        assert [t.type for t in newer.client.agent.tasks] == ["train"] and newer.error is None


def test_a_reply_larger_than_its_task_allows_is_refused_before_it_is_kept():
    """The limit comes from the task that was sent (what the strategy expects), not from the registration."""
    with FakeFederation(deadline_s=0.2) as fed:
        fed.client("0")
        assert fed.fleet.exchange({"0": Task("train", 1)}, limits={"0": 8}) == {}
        assert fed.fleet.inbox.rejected["too_large"] >= 1 and fed.fleet.results == {}
        assert list(fed.fleet.exchange({"0": Task("train", 2)})) == ["0"]  # the registration's limit: accepted


def test_a_lost_stop_is_sent_again_until_the_client_says_offline():
    """The run's end: a stop the broker loses (seen with the embedded broker as the server hung up) is sent again, so
    the client stops instead of waiting for a server that is gone; a client already stopped is not waited for."""
    with FakeFederation() as fed:
        first, second = fed.client("0"), fed.client("1")
        fed.net.drop_next(lambda topic, env: topic == fed.task_topic("1") and env.type == "task")
        fed.fleet.close()
        wait_until(lambda: first.done() and second.done(), "both clients to stop")
        assert [topic for topic, _ in fed.net.dropped] == [fed.task_topic("1")]
        assert fed.fleet.offline == {"0", "1"}
        assert [fed.net.count("task", fed.task_topic(cid)) for cid in "01"] == [1, 1]  # the lost one is in `dropped`
