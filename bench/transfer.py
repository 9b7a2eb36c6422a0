"""Moving a model end to end over MQTT: fedge's validated transfer against plain paho and a raw socket.

    python bench/transfer.py [--sizes 1,10,100] [--brokers embedded,mosquitto] [--repeats 3]

For each model size (MB of float32 weights) and broker, in this one run:
- fedge: encode the result (JSON + safetensors), chunk, hash, publish at QoS 1 through the broker with
  authentication and ACLs on, then on the receiving side check every frame (fedge.mqtt.Inbox),
  reassemble, verify the SHA-256, decode and check keys/shapes/dtypes/finiteness against the spec;
- plain paho: the same number of bytes in chunks of the same size at QoS 1, received and counted;
- raw socket: the same bytes over a loopback TCP socket (no broker).
Prints the median seconds, MB/s, and fedge's throughput as a fraction of plain paho's.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import paho.mqtt.client as paho  # noqa: E402
import torch  # noqa: E402

from bench.compare import hardware  # noqa: E402
from fedge.broker import EmbeddedBroker, generate_users, write_mosquitto_config  # noqa: E402
from fedge.constants import CHUNK_SIZE  # noqa: E402
from fedge.layers import LayerSpec  # noqa: E402
from fedge.messages import Result, Weights  # noqa: E402
from fedge.mqtt import Broker, Endpoint, Inbox  # noqa: E402
from fedge.spec import make_spec  # noqa: E402
from fedge.weights import check_state  # noqa: E402
from fedge.wire import decode_result, encode_result  # noqa: E402

RUN = "bench"
MOSQUITTO = "/usr/sbin/mosquitto"
TIMEOUT_S = 300.0


def model_of(megabytes: float) -> Weights:
    """A one-block linear model with about `megabytes` MB of float32 weights."""
    width = 1024
    out = max(1, int(megabytes * 1e6 / 4 / width))
    spec = make_spec("blob", (width,), out, [("fc", [LayerSpec("linear", {"in_features": width, "out_features": out})])])
    gen = torch.Generator().manual_seed(0)
    state = {"blocks.0.0.weight": torch.randn(out, width, generator=gen), "blocks.0.0.bias": torch.zeros(out)}
    check_state(spec, state)
    return Weights(spec, state)


def fedge_once(broker: Broker, users: dict[str, str], weights: Weights) -> tuple[float, int]:
    """Seconds from encoding to a decoded, validated result on the other side; payload bytes."""
    done = threading.Event()
    got: list[Result] = []

    def on_frame(topic: str, data: bytes) -> None:
        d = inbox.receive(topic, data)
        if d is not None:
            r = decode_result(d.payload)
            for w in r.models.values():
                check_state(w.spec, w.state)
            got.append(r)
            done.set()

    inbox = Inbox(RUN, lambda kind, client, env: 1 << 30)
    rx = Endpoint(Broker(broker.host, broker.port, username="server", password=users["server"]), "server",
                  [f"fedge/{RUN}/result/+"], on_frame)
    tx = Endpoint(Broker(broker.host, broker.port, username="a", password=users["a"]), "a", [], lambda t, d: None)
    rx.start(30)
    tx.start(30)
    time.sleep(0.2)  # let the subscription settle
    try:
        start = time.perf_counter()
        payload = encode_result(Result("a", 0, "train", 1, {}, {"local": weights}))
        tx.publish(f"fedge/{RUN}/result/a", "result", 0, payload, reply_to="0" * 32, chunk_size=CHUNK_SIZE)
        if not done.wait(TIMEOUT_S):
            raise RuntimeError("fedge transfer did not complete")
        seconds = time.perf_counter() - start
        assert torch.equal(got[0].models["local"].state["blocks.0.0.weight"], weights.state["blocks.0.0.weight"])
        return seconds, len(payload)
    finally:
        tx.stop()
        rx.stop()


def paho_client(broker: Broker, user: str, password: str, protocol: int) -> paho.Client:
    c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=user, protocol=protocol)
    c.username_pw_set(user, password)
    c.max_inflight_messages_set(64)
    c.connect(broker.host, broker.port)
    c.loop_start()
    return c


def paho_once(broker: Broker, users: dict[str, str], nbytes: int, protocol: int) -> float:
    """Seconds to publish `nbytes` in CHUNK_SIZE pieces at QoS 1 and receive them all, no checks."""
    received = [0]
    done = threading.Event()

    def on_message(client: paho.Client, userdata: object, msg: paho.MQTTMessage) -> None:
        received[0] += len(msg.payload)
        if received[0] >= nbytes:
            done.set()

    rx = paho_client(broker, "server", users["server"], protocol)
    rx.on_message = on_message
    rx.subscribe(f"fedge/{RUN}/result/+", qos=1)
    tx = paho_client(broker, "a", users["a"], protocol)
    time.sleep(0.3)
    try:
        data = bytes(nbytes)
        start = time.perf_counter()
        for i in range(0, nbytes, CHUNK_SIZE):
            tx.publish(f"fedge/{RUN}/result/a", data[i:i + CHUNK_SIZE], qos=1)
        if not done.wait(TIMEOUT_S):
            raise RuntimeError("plain paho transfer did not complete")
        return time.perf_counter() - start
    finally:
        for c in (tx, rx):
            c.disconnect()
            c.loop_stop()


def socket_once(nbytes: int) -> float:
    """Seconds to push `nbytes` through a loopback TCP socket to a reading thread."""
    server = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def read() -> None:
        conn, _ = server.accept()
        left = nbytes
        buf = bytearray(1 << 20)
        while left > 0:
            left -= conn.recv_into(buf)
        conn.close()
        done.set()

    threading.Thread(target=read, daemon=True).start()
    data = bytes(nbytes)
    start = time.perf_counter()
    with socket.create_connection(server.getsockname()) as s:
        s.sendall(data)
        done.wait(TIMEOUT_S)
    seconds = time.perf_counter() - start
    server.close()
    return seconds


class Mosquitto:
    """Debian's Mosquitto with a config fedge wrote (passwords, ACLs), on a free port."""

    def __init__(self, users: dict[str, str]) -> None:
        self.dir = tempfile.TemporaryDirectory(prefix="fedge-bench-")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        conf = write_mosquitto_config(Path(self.dir.name), users, port=self.port, run_as="root")
        self.proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("mosquitto did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait()
        self.dir.cleanup()


def median(fn: Callable[[], float], repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1,10,100", help="model sizes in MB, comma-separated")
    p.add_argument("--brokers", default="embedded,mosquitto")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    sizes = [float(s) for s in args.sizes.split(",")]
    users = generate_users(["a"])
    print(f"hardware: {hardware()}; chunk size {CHUNK_SIZE // 1024} KiB, QoS 1, median of {args.repeats}")
    print(f"{'broker':10s} {'MB':>6s} {'fedge s':>8s} {'fedge MB/s':>10s} {'paho s':>8s} {'paho MB/s':>9s} "
          f"{'socket MB/s':>11s} {'fedge/paho':>10s}")
    for name in args.brokers.split(","):
        if name == "embedded":
            embedded = EmbeddedBroker(users=users).start()
            broker, stop, protocol = Broker("127.0.0.1", embedded.port), embedded.stop, paho.MQTTv311
        else:
            mosq = Mosquitto(users)
            broker, stop, protocol = Broker("127.0.0.1", mosq.port), mosq.stop, paho.MQTTv5
        try:
            for mb in sizes:
                weights = model_of(mb)
                runs = [fedge_once(broker, users, weights) for _ in range(args.repeats)]
                fedge_s, nbytes = statistics.median(r[0] for r in runs), runs[0][1]
                paho_s = median(lambda: paho_once(broker, users, nbytes, protocol), args.repeats)
                sock_s = median(lambda: socket_once(nbytes), args.repeats)
                mbytes = nbytes / 1e6
                print(f"{name:10s} {mbytes:6.1f} {fedge_s:8.3f} {mbytes / fedge_s:10.0f} {paho_s:8.3f} "
                      f"{mbytes / paho_s:9.0f} {mbytes / sock_s:11.0f} {paho_s / fedge_s:10.2f}", flush=True)
        finally:
            stop()


if __name__ == "__main__":
    main()
