"""Moving a model end to end over MQTT: fedge's validated transfer against plain paho and a raw socket.

    python bench/transfer.py [--sizes 1,10,100] [--brokers embedded,mosquitto] [--repeats 3]

For each model size (MB of float32 weights) and broker, in this one run:
- fedge: from the encoded result (JSON + safetensors), chunk, hash, publish at QoS 1 through the broker with
  authentication and ACLs on, then on the receiving side check every frame (fedge.brokers.mqtt.Inbox),
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
from fedge.brokers.access import generate_users  # noqa: E402
from fedge.brokers.embedded_broker import EmbeddedBroker  # noqa: E402
from fedge.brokers.mosquitto import write_mosquitto_config  # noqa: E402
from fedge.brokers.mqtt import Broker, Endpoint, Inbox  # noqa: E402
from fedge.constants import CHUNK_SIZE  # noqa: E402
from fedge.model.layers import LayerSpec  # noqa: E402
from fedge.model.spec import make_spec  # noqa: E402
from fedge.model.weights import check_state  # noqa: E402
from fedge.wire.codec import decode_result, encode_result  # noqa: E402
from fedge.wire.messages import Result, Weights  # noqa: E402

RUN = "bench"
MOSQUITTO = "/usr/sbin/mosquitto"
TIMEOUT_S = 300.0


def model_of(megabytes: float) -> Weights:
    """A one-block linear model with about `megabytes` MB of float32 weights."""
    width = 1024
    out = max(1, int(megabytes * 1e6 / 4 / width))
    spec = make_spec(
        "blob", (width,), out, [("fc", [LayerSpec("linear", {"in_features": width, "out_features": out})])]
    )
    gen = torch.Generator().manual_seed(0)
    state = {"blocks.0.0.weight": torch.randn(out, width, generator=gen), "blocks.0.0.bias": torch.zeros(out)}
    check_state(spec, state)
    return Weights(spec, state)


def receiver(kind: str, port: int, nbytes: int, count: int) -> None:
    """The receiving side, in its own process (as the server is): subscribe, then print `done <monotonic>`
    after each whole transfer. fedge: every frame checked by the Inbox, joined, hashed, decoded and the
    weights checked against the spec; paho: bytes counted. The password comes on stdin."""
    password = sys.stdin.readline().strip()
    seen = [0, 0]  # transfers done, bytes received (paho)

    def finished() -> None:
        seen[0] += 1
        print(f"done {time.monotonic()}", flush=True)

    if kind == "fedge":
        inbox = Inbox(RUN, lambda k, client, env: 1 << 30)

        def on_frame(topic: str, data: bytes) -> None:
            d = inbox.receive(topic, data)
            if d is not None:
                for w in decode_result(d.payload).models.values():
                    check_state(w.spec, w.state)
                finished()

        rx = Endpoint(
            Broker("127.0.0.1", port, username="server", password=password),
            "server",
            [f"fedge/{RUN}/result/+"],
            on_frame,
        )
        rx.start(30)
        stop = rx.stop
    else:

        def on_message(client: paho.Client, userdata: object, msg: paho.MQTTMessage) -> None:
            seen[1] += len(msg.payload)
            if seen[1] >= nbytes * (seen[0] + 1):
                finished()

        protocol = paho.MQTTv311 if kind == "paho311" else paho.MQTTv5
        c = paho_client(Broker("127.0.0.1", port), "server", password, protocol)
        c.on_message = on_message
        c.subscribe(f"fedge/{RUN}/result/+", qos=1)
        stop = c.loop_stop
    time.sleep(0.5)  # the subscription is in place
    print("ready", flush=True)
    while seen[0] < count:
        time.sleep(0.01)
    stop()


def transfers(
    kind: str, broker: Broker, users: dict[str, str], data: bytes, repeats: int, protocol: int
) -> list[float]:
    """Seconds per transfer of `data` (a fedge result payload, or plain bytes for paho) to a receiver process."""
    child = subprocess.Popen(
        [sys.executable, __file__, "--receiver", kind, str(broker.port), str(len(data)), str(repeats)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write(users["server"] + "\n")
    child.stdin.flush()
    if child.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the {kind} receiver did not start")
    if kind == "fedge":
        tx = Endpoint(Broker(broker.host, broker.port, username="a", password=users["a"]), "a", [], lambda t, d: None)
        tx.start(30)
    else:
        c = paho_client(broker, "a", users["a"], protocol)
    times = []
    try:
        for _ in range(repeats):
            start = time.monotonic()
            if kind == "fedge":  # chunk, hash, publish
                tx.publish(f"fedge/{RUN}/result/a", "result", 0, data, reply_to="0" * 32, chunk_size=CHUNK_SIZE)
            else:
                for i in range(0, len(data), CHUNK_SIZE):
                    c.publish(f"fedge/{RUN}/result/a", data[i : i + CHUNK_SIZE], qos=1)
            line = child.stdout.readline().split()
            if not line or line[0] != "done":
                raise RuntimeError(f"the {kind} receiver failed")
            times.append(float(line[1]) - start)
    finally:
        if kind == "fedge":
            tx.stop()
        else:
            c.disconnect()
            c.loop_stop()
        child.wait(30)
    return times


def paho_client(broker: Broker, user: str, password: str, protocol: int) -> paho.Client:
    c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=user, protocol=protocol)
    c.username_pw_set(user, password)
    c.max_inflight_messages_set(64)
    c.connect(broker.host, broker.port)
    c.loop_start()
    return c


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
    p.add_argument("--receiver", nargs=4, metavar=("KIND", "PORT", "NBYTES", "COUNT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.receiver:
        kind, port, nbytes, count = args.receiver
        receiver(kind, int(port), int(nbytes), int(count))
        return
    sizes = [float(s) for s in args.sizes.split(",")]
    users = generate_users(["a"])
    print(
        f"hardware: {hardware()}; chunk size {CHUNK_SIZE // 1024} KiB, QoS 1, median of {args.repeats}; "
        "sender and receiver in separate processes; fedge's time starts from the encoded payload "
        "(encoding the model is shown apart)"
    )
    print(
        f"{'broker':10s} {'MB':>6s} {'encode s':>8s} {'fedge s':>8s} {'fedge MB/s':>10s} {'paho s':>8s} "
        f"{'paho MB/s':>9s} {'socket MB/s':>11s} {'fedge/paho':>10s}"
    )
    for name in args.brokers.split(","):
        if name == "embedded":
            embedded = EmbeddedBroker(users=users).start()
            broker, stop, kind = Broker("127.0.0.1", embedded.port), embedded.stop, "paho311"
        else:
            mosq = Mosquitto(users)
            broker, stop, kind = Broker("127.0.0.1", mosq.port), mosq.stop, "paho5"
        protocol = paho.MQTTv311 if kind == "paho311" else paho.MQTTv5
        try:
            for mb in sizes:
                weights = model_of(mb)
                start = time.perf_counter()
                payload = encode_result(Result("a", 0, "train", 1, {}, {"local": weights}))
                encode_s = time.perf_counter() - start
                fedge_s = statistics.median(transfers("fedge", broker, users, payload, args.repeats, protocol))
                paho_s = statistics.median(transfers(kind, broker, users, bytes(len(payload)), args.repeats, protocol))
                sock_s = median(lambda: socket_once(len(payload)), args.repeats)
                mbytes = len(payload) / 1e6
                print(
                    f"{name:10s} {mbytes:6.1f} {encode_s:8.3f} {fedge_s:8.3f} {mbytes / fedge_s:10.0f} {paho_s:8.3f} "
                    f"{mbytes / paho_s:9.0f} {mbytes / sock_s:11.0f} {paho_s / fedge_s:10.2f}",
                    flush=True,
                )
        finally:
            stop()


if __name__ == "__main__":
    main()
