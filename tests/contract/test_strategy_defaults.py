"""Every registered strategy runs with `fedge run --strategy NAME` and no flag that picks its fleet (issue 33): a
strategy the run's defaults cannot serve gets its paper's fleet (fedge.config.paper_fleets), the run says what it
chose and why, and a flag, --set or the config file still wins. The other flags below only shrink the run (one round
of one epoch on 40 samples per client, in one process)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from fedge.config import RunConfig, load_config, load_config_chosen, paper_fleets, parse_overrides
from launch.cli import main
from server.strategy import STRATEGIES, parse_options

pytestmark = pytest.mark.timeout(240)
SCALE = ["--transport", "inproc", "--workers", "1", "--rounds", "1", "--local-epochs", "1", "--no-progress"]
SCALE_KEYS = {"max_samples_per_client": 40, "max_public_samples": 40, "export_onnx": "false"}
# where a strategy has these options: its server step in seconds (pFedClub's and pFedHR's stitch fine-tuning)
FAST_OPTIONS = {"finetune_epochs": 1, "finetune_min_steps": 0, "max_candidates": 2}


def small(name: str) -> list[str]:
    known = {option for option, *_ in STRATEGIES.get(name).options_type.describe()}
    keys = SCALE_KEYS | {k: v for k, v in FAST_OPTIONS.items() if k in known}
    return SCALE + [arg for k, v in keys.items() for arg in ("--set", f"{k}={v}")]


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_runs_with_only_its_name(name, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "--strategy", name, "--out", str(out), *small(name)]) == 0
    printed = capsys.readouterr()
    config = json.loads((out / "config.json").read_text())
    fleet = paper_fleets().get(name)
    if fleet is not None:
        assert f"{name} runs on its paper's fleet" in printed.err and fleet.why in printed.err
        for key, value in fleet.values.items():
            assert config[key] == (list(value) if isinstance(value, tuple) else value), key
    else:
        assert "paper's fleet" not in printed.err
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["client_status"]) == RunConfig().clients
    assert f"of {RunConfig().clients} clients" in printed.out


def test_a_flag_the_config_file_or_set_wins_over_the_paper_fleet(tmp_path):
    cfg, chosen = load_config_chosen(None, {"strategy": "fedmn", "partition": "dirichlet"})
    assert cfg.partition == "dirichlet" and "partition" not in chosen and cfg.zoo == "fedmn_2x2x2_cnn1"
    toml = tmp_path / "run.toml"
    toml.write_text('strategy = "fedtrans"\nzoo = "cnn1"\n')
    cfg, chosen = load_config_chosen(toml, {})
    assert cfg.zoo == "cnn1" and chosen == {"profiles": ("rpi-zero-2w", "rpi-4")}
    assert load_config(toml, {"profiles": "rpi-4"}).profiles == ("rpi-4",)
    # a run's config.json names every key, so a client or a resumed server reading it gets exactly that run
    assert load_config_chosen(None, {"strategy": "dcpfl", "zoo": "cnn2"}) == (
        RunConfig(strategy="dcpfl", zoo="cnn2"),
        {},
    )
    written = tmp_path / "config.json"
    written.write_text(RunConfig(strategy="fedavg").to_json())
    assert load_config_chosen(written, {}) == (RunConfig(strategy="fedavg"), {})


def test_every_paper_fleet_is_a_registered_strategys():
    assert set(paper_fleets()) <= set(STRATEGIES)


def test_an_option_named_as_a_run_level_key_is_set_as_options_name():
    # `--set alpha=` is the Dirichlet's alpha; FedTrans's option alpha is reached as options.alpha, for every such
    # option of every registered strategy
    run_level = {f.name for f in dataclasses.fields(RunConfig)}
    shadowed = [
        (name, option, default)
        for name in STRATEGIES
        for option, _, default, _ in STRATEGIES.get(name).options_type.describe()
        if option in run_level
    ]
    assert ("fedtrans", "alpha", 0.9) in shadowed
    for name, option, default in shadowed:
        cfg = load_config(None, parse_overrides([f"strategy={name}", f"{option}=0.25", f"options.{option}={default}"]))
        assert cfg.options == {option: str(default)} and getattr(cfg, option) == 0.25, (name, option)
        parsed = parse_options(name, cfg.options)
        assert getattr(parsed, option) == default
