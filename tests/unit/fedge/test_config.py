"""fedge.config's `widths` key: the zoo's width preset, checked, and carried by config.json to every process."""

import pytest

from fedge.config import ConfigError, RunConfig, config_from, load_config, parse_overrides

pytestmark = pytest.mark.timeout(30)


def test_widths_defaults_to_cpu_and_takes_paper_from_set():
    assert RunConfig().widths == "cpu"
    assert config_from(parse_overrides(["widths=paper"])).widths == "paper"


@pytest.mark.parametrize("value", ["huge", "PAPER", ""])
def test_unknown_widths_is_a_config_error_listing_the_presets(value):
    with pytest.raises(ConfigError, match=rf"widths must be one of cpu, paper .*got '{value}'"):
        config_from({"widths": value})


def test_widths_survives_config_json(tmp_path):
    # what `fedge run` writes for its client processes and `fedge server --resume` reads back
    path = tmp_path / "config.json"
    path.write_text(config_from({"widths": "paper", "zoo": "II"}).to_json())
    cfg = load_config(path, {})
    assert (cfg.widths, cfg.zoo) == ("paper", "II")


def test_widths_from_a_toml_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('widths = "paper"\n')
    assert load_config(path, {}).widths == "paper"
    assert load_config(path, {"widths": "cpu"}).widths == "cpu"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"workers": "-1"}, r"workers must be 0 \(automatic\) or a positive integer, got -1"),
        ({"engine": "dask"}, r"engine must be processes, ray or batched, got 'dask'"),
        ({"engine": "batched", "client_device": "gpu"}, r"client_device must be cpu, cuda or cuda:N, got 'gpu'"),
        ({"client_device": "cuda", "transport": "inproc"}, r"client_device cuda trains .* set transport inproc and"),
        ({"client_device": "cuda", "engine": "batched"}, r"client_device cuda trains the in-process simulation's"),
    ],
)
def test_the_simulations_worker_keys_refuse_bad_values(values, message):
    with pytest.raises(ConfigError, match=message):
        config_from(values)
    assert config_from({"workers": "4", "engine": "ray", "ray_address": "ray://head:10001"}).workers == 4
    gpu = {"engine": "batched", "client_device": "cuda:1", "transport": "inproc"}
    assert config_from(gpu).client_device == "cuda:1"
