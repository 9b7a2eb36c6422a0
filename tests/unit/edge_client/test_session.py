"""The client's MQTT session (EdgeClient) against a real Fleet over an in-memory link: refused registrations,
re-sent uploads and their repeats, the server's stop, a restarted server. Real brokers: tests/integration."""

import pytest

from edge_client.session import MAX_SENDS, ClientStopped
from fedge.wire.messages import Task
from server.fleet import Fleet

from helpers.fake_link import RUN, WAIT_S, FakeFederation, wait_until

pytestmark = pytest.mark.timeout(60)


def test_a_refused_registration_stops_the_client_with_the_servers_reason():
    with FakeFederation(check_info=lambda info: ("bad_spec", "cnn1 does not fit rpi-4")) as fed:
        refused = fed.client("0", registered=False)
        wait_until(refused.done, "the refused client to stop")
        assert isinstance(refused.error, ClientStopped) and "cnn1 does not fit rpi-4" in str(refused.error)
        assert fed.fleet.inbox.rejected == {"bad_spec": 1} and fed.fleet.clients == {}


def test_a_lost_upload_is_sent_again_after_the_ack_timeout():
    with FakeFederation() as fed:
        client = fed.client("0", ack_timeout_s=0.01).client
        fed.net.drop_next(lambda topic, env: env.type == "result")
        results = fed.fleet.exchange({"0": Task("train", 1)})  # waits for the second send
        assert list(results) == ["0"] and len(fed.net.dropped) == 1 and fed.net.count("result") == 1
        wait_until(lambda: not client.pending, "the re-sent result to be acknowledged")
        resent = next(env for _, env in fed.net.sent if env.type == "result")
        assert resent.msg_id == fed.net.dropped[0][1].msg_id  # the same message, not a new result


def test_a_lost_acknowledgement_makes_repeats_that_the_server_recognises():
    with FakeFederation() as fed:
        client = fed.client("0", ack_timeout_s=0.01).client
        fed.net.drop_next(lambda topic, env: env.type == "ack" and env.round == 1)
        assert list(fed.fleet.exchange({"0": Task("train", 1)})) == ["0"]
        wait_until(
            lambda: fed.fleet.inbox.joiner.duplicates == MAX_SENDS - 1 and not client.pending,
            "the client to give up on the acknowledgement",
        )
        assert fed.net.count("result") == MAX_SENDS  # a bounded number of sends, each the same message
        assert len({env.msg_id for _, env in fed.net.sent if env.type == "result"}) == 1
        assert fed.fleet.inbox.rejected == {}  # repeats are dropped, not rejected


def test_the_servers_stop_ends_the_session_and_a_stop_for_another_session_does_not():
    with FakeFederation() as fed:
        serving = fed.client("0")
        fed.fleet._stop_session("0", "another-session")  # a takeover stop for some other connection
        assert list(fed.fleet.exchange({"0": Task("train", 1)})) == ["0"]  # handled after it: still serving
        fed.fleet.close()
        wait_until(serving.done, "the client to stop")
        assert serving.error is None
        assert [t.type for t in serving.client.agent.tasks] == ["train"]  # stops never reach the agent


def test_a_restarted_server_is_registered_with_again():
    with FakeFederation() as fed:
        serving = fed.client("0")
        restarted = Fleet(fed.net.connect, RUN, lambda info: None, heartbeat_s=60.0)
        restarted.start(WAIT_S)  # announces a new server session
        wait_until(lambda: "0" in restarted.clients, "the client to register with the new server")
        assert serving.client.server_session == restarted.session
        restarted.close()
