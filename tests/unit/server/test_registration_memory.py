"""The server refuses a client whose training footprint at the run's batch size exceeds its profile's
memory_bytes ("over_memory", both numbers in the message, counted), and accepts one within it."""

import pytest

from fedge.model.layers import LayerSpec as L
from fedge.model.spec import make_spec
from fedge.wire.messages import ClientInfo
from server.registration import registration_check

from helpers.fake_link import EchoAgent, FakeFederation, wait_until

pytestmark = pytest.mark.timeout(60)

# 20 ReLUs on a 1x512x512 input: 20 params and 10 MACs (within every limit of rpi-zero-2w but memory), and
# 21 x 262,144 activation elements per sample = 22.0 MB at batch 1, 352.3 MB at batch 16 (> 268.4 MB).
WIDE = make_spec(
    "wide",
    (1, 512, 512),
    10,
    [("body", [L("relu")] * 20 + [L("adaptive_avgpool"), L("flatten"), L("linear", {"out_features": 10})])],
)


def info(batch_examples: int = 100) -> ClientInfo:
    return ClientInfo("0", WIDE.with_origin("0"), "rpi-zero-2w", batch_examples, 20)


def test_a_footprint_over_memory_bytes_is_refused_with_both_numbers() -> None:
    code, message = registration_check(batch_size=16)(info())
    assert code == "over_memory"
    assert "training footprint 352.3 MB" in message and "activations 352.3 MB at batch 16" in message
    assert "> memory_bytes 268.4 MB of profile rpi-zero-2w" in message


def test_a_footprint_within_memory_bytes_is_accepted() -> None:
    assert registration_check(batch_size=1)(info()) is None
    assert registration_check(batch_size=16)(info(batch_examples=1)) is None  # a batch never exceeds the data


def test_an_over_memory_registration_is_refused_and_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(EchoAgent, "info", lambda self: info())
    with FakeFederation(check_info=registration_check(batch_size=16)) as fed:
        refused = fed.client("0", registered=False)
        wait_until(refused.done, "the refused client to stop")
        assert "memory_bytes 268.4 MB" in str(refused.error) and "training footprint 352.3 MB" in str(refused.error)
        assert fed.fleet.inbox.rejected == {"over_memory": 1} and fed.fleet.clients == {}
