"""Federations whose clients each read their own folder of PNG digits written by the test (`fedge client
--data-dir`, config key data_dir), and a server whose public set is the operator's folder (`--public-data`)."""

import dataclasses
import json
import logging

import numpy as np
import pytest
from PIL import Image

from fedge.config import config_from
from fedge.data.datasets import load_dataset
from fedge.wire.codec import encode_info
from launch.client import client_agents
from launch.simulation import run_simulation

from helpers.federation import over_embedded_broker

pytestmark = pytest.mark.timeout(300)
IDS = ["0", "1", "2"]
PER_CLASS = 15  # images of each of a device's two digits


def write_pngs(root, images, labels=None):
    """`root/<digit>/<k>.png` (or `root/<k>.png` without labels) from uint8 (N, 1, 28, 28) digits."""
    for k, image in enumerate(images):
        folder = root if labels is None else root / str(int(labels[k]))
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image[0]).save(folder / f"{k}.png")


def write_fleet(tmp_path) -> None:
    """Device i holds PER_CLASS mnist-5k images of digits 2i and 2i+1 in tmp/dev<i>; the operator's public
    folder holds 24 loose images of other examples (unlabelled)."""
    ds = load_dataset("mnist-5k")
    for i in range(len(IDS)):
        chosen = np.concatenate([np.flatnonzero(ds.y == d)[:PER_CLASS] for d in (2 * i, 2 * i + 1)])
        write_pngs(tmp_path / f"dev{i}", ds.x[chosen], ds.y[chosen])
    write_pngs(tmp_path / "public", ds.x[-24:])


def config(tmp_path, name, **kw):
    values = dict(
        strategy="fedavg",
        dataset="mnist-5k",
        zoo="cnn1",
        clients=3,
        active=3,
        rounds=2,
        local_epochs=1,
        batch_size=16,
        seed=2,
        device="cpu",
        heartbeat_s=1.0,
        round_deadline_s=60.0,
        register_timeout_s=60.0,
        run_id=f"own{name}",
        out=str(tmp_path / name),
        export_onnx=False,
        data_dir=str(tmp_path / "dev{id}"),
    )
    return config_from(values | kw)


def test_clients_on_their_own_folders_over_the_embedded_broker(tmp_path):
    """Server and `fedge client`'s agents in threads of this process; each client registers the sizes of its own
    folder (80 % train, 20 % test held out) and the rounds run on them."""
    write_fleet(tmp_path)
    cfg = config(tmp_path, "mqtt")
    summary, agents = over_embedded_broker(cfg)

    assert {(a.info().num_train, a.info().num_test) for a in agents} == {(24, 6)}
    for i, a in enumerate(agents):  # labels by class folder: device i has digits 2i and 2i+1 only
        assert set(a.data.y_train.tolist()) == {2 * i, 2 * i + 1} and set(a.data.y_test.tolist()) == {2 * i, 2 * i + 1}
    accuracy = summary["final_accuracy"]["per_client"]
    assert set(accuracy) == set(IDS) and summary["rejected_replies"] == {}
    assert all(0.0 <= acc <= 1.0 for acc in accuracy.values())
    rows = [json.loads(line) for line in (tmp_path / "mqtt" / "metrics.jsonl").read_text().splitlines()]
    assert sorted((r["round"], r["client"]) for r in rows if r["trained"]) == [(r, c) for r in range(2) for c in IDS]


def test_registration_carries_sizes_and_the_model_never_pixels(tmp_path):
    """A client's registration payload is the same whatever its images hold, as long as their number is."""
    write_fleet(tmp_path)
    cfg = config(tmp_path, "reg")
    dark = tmp_path / "dark"
    for png in (tmp_path / "dev0").rglob("*.png"):
        target = dark / png.relative_to(tmp_path / "dev0")
        target.parent.mkdir(parents=True, exist_ok=True)
        Image.new("L", (28, 28), 0).save(target)

    mine = client_agents(cfg, ["0"])[0]
    other = client_agents(dataclasses.replace(cfg, data_dir=str(dark)), ["0"])[0]

    assert not mine.data.x_train.equal(other.data.x_train)
    assert encode_info(mine.info()) == encode_info(other.info())
    assert (mine.info().num_train, mine.info().num_test) == (24, 6)


def test_pfedclub_with_own_client_folders_and_the_operators_unlabelled_public_folder(tmp_path, caplog):
    """The in-process simulation honours data_dir and public_data too; pFedClub's CKA runs on the operator's
    public images."""
    write_fleet(tmp_path)
    cfg = config(
        tmp_path,
        "pfedclub",
        strategy="pfedclub",
        zoo="I",
        transport="inproc",
        public_data=str(tmp_path / "public"),
        finetune_epochs=1,
        finetune_min_steps=0,
    )
    with caplog.at_level(logging.INFO, logger="launch.server"):
        summary = run_simulation(cfg, progress=False)
    assert set(summary["final_accuracy"]["per_client"]) == set(IDS)
    assert f"public set of 24 images from {tmp_path / 'public'}" in caplog.text


def test_fedge_client_refuses_a_bad_folder_with_one_line_naming_it(tmp_path, capsys):
    """`fedge client --data-dir` (the config's data_dir, per device) stops before connecting on bad data."""
    from launch.cli import build_parser, main, run_config

    write_fleet(tmp_path)
    (tmp_path / "dev1" / "cats").mkdir()
    args = ["client", "--broker", "mqtt://127.0.0.1:1", "--id", "1", "--data-dir", str(tmp_path / "dev{id}")]
    assert run_config(build_parser().parse_args(args), ("data_dir",)).data_dir == str(tmp_path / "dev{id}")
    server = build_parser().parse_args(["server", "--broker", "mqtt://127.0.0.1:1", "--public-data", "p.npz"])
    assert run_config(server).public_data == "p.npz"

    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedge: error: ") and "cats: unknown class folder 'cats'; the run's classes are 0, 1" in err
