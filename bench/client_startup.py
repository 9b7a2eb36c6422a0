"""How long `fedge client` takes from process start to its first MQTT status message, and how many modules it
imports by then (and which heavy ones), for one source tree or two side by side.

    python bench/client_startup.py                            # this tree
    python bench/client_startup.py --before /path/to/old/tree --before-entry fedge.cli

The client runs on its own data (a small generated .npz, dataset `mnist`, cnn1 on rpi-4) against the embedded
broker of this tree; nothing else runs. Times are the median of --repeats starts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import paho.mqtt.client as paho

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedge.brokers.access import generate_users  # noqa: E402
from fedge.brokers.embedded_broker import EmbeddedBroker  # noqa: E402

HEAVY = (
    "server",
    "amqtt",
    "matplotlib",
    "sklearn",
    "mlxtend",
    "export",
    "onnx",
    "onnxruntime",
    "executorch",
    "scipy",
    "pandas",
)
SCRIPT = """import atexit, json, sys
out = sys.argv[1]
atexit.register(lambda: open(out, "w").write(json.dumps(sorted(sys.modules))))
from importlib import import_module
sys.exit(import_module(sys.argv[2]).main(sys.argv[3:]))
"""


def write_data(path: Path) -> None:
    """A tiny MNIST-shaped .npz (a device's own data): 200 training and 50 test images of 10 classes."""
    rng = np.random.default_rng(0)
    np.savez(
        path,
        x_train=rng.integers(0, 256, (200, 28, 28), dtype=np.uint8),
        y_train=np.arange(200) % 10,
        x_test=rng.integers(0, 256, (50, 28, 28), dtype=np.uint8),
        y_test=np.arange(50) % 10,
    )


def start_once(
    tree: Path, entry: str, broker: EmbeddedBroker, users: dict[str, str], tmp: Path, run: str
) -> tuple[float, list[str]]:
    """Seconds from spawning `fedge client` until its first status message, and the modules it had imported."""
    config, secrets, modules = tmp / "config.json", tmp / "passwords", tmp / f"modules-{run}.json"
    config.write_text(
        json.dumps(
            {
                "dataset": "mnist",
                "data": str(tmp / "data.npz"),
                "zoo": "cnn1",
                "clients": 1,
                "active": 1,
                "run_id": run,
                "profiles": ["rpi-4"],
            }
        )
    )
    secrets.write_text("".join(f"{u}:{p}\n" for u, p in users.items()))
    os.chmod(secrets, 0o600)
    heard = threading.Event()
    sub = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="server")
    sub.username_pw_set("server", users["server"])
    sub.on_message = lambda *_: heard.set()
    sub.connect("127.0.0.1", broker.port)
    sub.subscribe(f"fedge/{run}/status/0", qos=1)
    sub.loop_start()
    time.sleep(0.5)  # the subscription is in place before the client starts
    env = dict(os.environ, PYTHONPATH=str(tree))
    argv = [
        sys.executable,
        "-c",
        SCRIPT,
        str(modules),
        entry,
        "client",
        "--broker",
        broker.url,
        "--config",
        str(config),
        "--id",
        "0",
        "--password-file",
        str(secrets),
        "--threads",
        "1",
    ]
    start = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        if not heard.wait(120):
            raise RuntimeError(f"the client did not come online: {proc.stderr.read().decode()[-2000:]}")
        seconds = time.perf_counter() - start
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
        sub.loop_stop()
        sub.disconnect()
    return seconds, json.loads(modules.read_text())


def measure(tree: Path, entry: str, repeats: int) -> dict[str, object]:
    users = generate_users(["0"])
    with tempfile.TemporaryDirectory() as tmp_name, EmbeddedBroker(users=users) as broker:
        tmp = Path(tmp_name)
        write_data(tmp / "data.npz")
        runs = [start_once(tree, entry, broker, users, tmp, f"startup{i}") for i in range(repeats)]
    modules = runs[-1][1]
    return {
        "seconds": statistics.median(s for s, _ in runs),
        "modules": len(modules),
        "heavy": sorted({m.split(".")[0] for m in modules if m.split(".")[0] in HEAVY}),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, help="another source tree to compare with (e.g. a git worktree)")
    p.add_argument("--before-entry", default="fedge.cli", help="the CLI module of that tree (default fedge.cli)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print(
        f"hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; median of {args.repeats} starts"
    )
    rows = [("this tree", measure(ROOT, "launch.cli", args.repeats))]
    if args.before:
        rows.insert(0, ("before", measure(args.before, args.before_entry, args.repeats)))
    for name, r in rows:
        print(
            f"{name:10s} start-up {r['seconds']:.2f} s, {r['modules']} modules imported, heavy: "
            f"{', '.join(r['heavy']) or 'none'}"
        )
    if len(rows) == 2:
        a, b = rows[0][1], rows[1][1]
        print(
            f"ratio this/before: start-up {b['seconds'] / a['seconds']:.2f}, modules {b['modules'] / a['modules']:.2f}"
        )


if __name__ == "__main__":
    main()
