"""The Fleet's view of each client's connections (sessions): restarts, takeovers, late wills, bounded memory."""

import pytest

from server.fleet import MAX_REPLACED_SESSIONS, Fleet

from helpers.fake_link import FakeBroker

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def fleet() -> Fleet:
    """A Fleet that is never connected: only its bookkeeping is exercised."""
    return Fleet(FakeBroker().connect, "r", lambda info: None)


def test_a_restart_is_no_takeover_and_the_old_sessions_late_will_is_ignored(fleet):
    assert not fleet._track_session("1", "old", "online")
    assert not fleet._track_session("1", "new", "online")  # the restarted process
    assert fleet._track_session("1", "old", "offline")  # its will, published late: says nothing about "new"
    assert fleet.sessions["1"] == "new" and fleet.takeovers == {}


def test_a_replaced_session_that_speaks_again_is_one_takeover(fleet):
    fleet._track_session("1", "first", "online")
    fleet._track_session("1", "second", "online")
    assert fleet._track_session("1", "first", "online")  # back: two processes share the id
    assert fleet._track_session("1", "first", "alive")
    assert fleet.takeovers == {"1": 1} and fleet.sessions["1"] == "second"


def test_a_client_cycling_session_ids_holds_a_bounded_record(fleet):
    for k in range(1000):
        fleet._track_session("x", f"s{k}", "online")
        fleet._track_session("x", f"s{k - 1}", "alive")
    assert len(fleet.replaced["x"]) == MAX_REPLACED_SESSIONS
