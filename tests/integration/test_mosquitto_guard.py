"""Tests that start Mosquitto skip on a machine without it (the README's promise), unless CI requires it."""

import pytest

from fedge.brokers.access import generate_users

from helpers import brokers


def test_starting_mosquitto_without_the_binary_skips_or_fails_as_asked(tmp_path, monkeypatch):
    monkeypatch.setattr(brokers, "MOSQUITTO", str(tmp_path / "no-such-mosquitto"))
    monkeypatch.delenv("FEDGE_REQUIRE_MOSQUITTO", raising=False)
    with pytest.raises(pytest.skip.Exception, match="Mosquitto not found"):
        brokers.MosquittoProcess(tmp_path / "m", generate_users(["a"]))
    monkeypatch.setenv("FEDGE_REQUIRE_MOSQUITTO", "1")
    with pytest.raises(pytest.fail.Exception, match="Mosquitto not found"):
        brokers.MosquittoProcess(tmp_path / "m", generate_users(["a"]))
