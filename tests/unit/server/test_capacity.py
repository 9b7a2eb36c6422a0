"""Client capacities from device profiles or a capacity file, and which models fit them."""

import json

import pytest

from device_profiles import get_profile
from fedge.model.zoo import create
from server.capacity import CapacityError, client_capacities, compatible, read_capacity_file

pytestmark = pytest.mark.timeout(30)


def test_json_and_csv_files_are_read(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"0": 9200000, "1": "3e6", "2": 1.0}))
    assert read_capacity_file(tmp_path / "c.json") == {"0": 9_200_000, "1": 3_000_000, "2": 1}
    (tmp_path / "c.csv").write_text("client,macs\n0,100\n 1 ,2.5e3\n")
    assert read_capacity_file(tmp_path / "c.csv") == {"0": 100, "1": 2500}
    (tmp_path / "realistic.csv").write_text("id,macs\n7,50\n")  # the FedTrans authors' columns
    assert read_capacity_file(tmp_path / "realistic.csv") == {"7": 50}


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("a.json", "{not json", "not valid JSON"),
        ("a.json", "[1, 2]", "JSON object"),
        ("a.json", '{"0": 0}', "client '0' has capacity 0"),
        ("a.json", '{"0": true}', "client '0' has capacity True"),
        ("a.json", '{"0": "many"}', "not a positive MAC count"),
        ("a.csv", "client,flops\n0,1\n", "columns client,macs"),
        ("a.csv", "", "columns client,macs"),
        ("a.csv", "client,macs\n0,-5\n", "client '0' has capacity '-5'"),
    ],
)
def test_malformed_files_are_refused_with_the_reason(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(CapacityError, match=message):
        read_capacity_file(tmp_path / name)


def test_an_unreadable_file_is_refused(tmp_path):
    with pytest.raises(CapacityError, match="cannot read capacity file"):
        read_capacity_file(tmp_path / "missing.json")


def test_capacities_come_from_profiles_or_from_a_file_that_lists_every_client(tmp_path):
    profiles = {"0": get_profile("rpi-zero-2w"), "1": get_profile("rpi-4"), "10": get_profile("rpi-4")}
    assert client_capacities(profiles) == {"0": 9_200_000, "1": 290_000_000, "10": 290_000_000}
    assert client_capacities(profiles, "") == client_capacities(profiles)
    (tmp_path / "c.json").write_text(json.dumps({"0": 5, "1": 6, "10": 7, "99": 8}))
    assert client_capacities(profiles, tmp_path / "c.json") == {"0": 5, "1": 6, "10": 7}
    (tmp_path / "short.json").write_text(json.dumps({"1": 6}))
    with pytest.raises(CapacityError, match=r"no capacity for clients \['0', '10'\]"):
        client_capacities(profiles, tmp_path / "short.json")


def test_compatible_takes_the_capacity_for_macs_and_the_profile_for_the_rest():
    spec = create("cnn4", (1, 28, 28), 10)  # 689,898 parameters, 42.7 M MACs
    assert compatible(spec, spec.macs, get_profile("rpi-4"))
    assert not compatible(spec, spec.macs - 1, get_profile("rpi-4"))
    zero = get_profile("rpi-zero-2w")  # max_macs 9.2 M, max_params 800 k
    assert not compatible(spec, zero.max_macs, zero)
    assert compatible(spec, 10**9, zero)  # a capacity file may raise the MAC limit above the profile's
    big = create("mobilenet_v3", (1, 28, 28), 10)  # 1.5 M parameters: over the profile's max_params
    assert not compatible(big, 10**9, zero)
