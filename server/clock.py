"""The simulated clock: what each client's training exchange would take on its device profile (download, compute,
upload), the round's simulated time, and the run's running totals (FedScale-style time-to-accuracy).

Only training tasks (those a strategy's `plan` makes) are charged; evaluation is not, as in FedScale, which
charges a round by its training clients. Compute counts FedScale's and FedTrans's training cost,
3 x forward MACs x samples x epochs (backward ~ 2x forward), plus, for a distillation task that carries a
"teacher" model, the teacher's forward pass over the client's samples once (the client computes the teacher's
logits once per task, edge_client/distill.py) and what else a strategy says its task does once per sample
(Strategy.other_macs: DC-PFL's statistics pass). Transfer charges the real payload bytes of the task and the reply
as the codec puts them on the wire, so in-process and MQTT runs agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from device_profiles import DeviceProfile, checked_count, transfer_seconds
from device_profiles.constants import DIRECTION_DOWN, DIRECTION_UP, TRAIN_COST_FACTOR
from fedge import constants as C
from fedge.checkpoint import Tree
from fedge.model.spec import ModelSpec
from fedge.teacher_program import shipped_spec
from fedge.wire.codec import encode_result, encode_task
from fedge.wire.messages import Result, Task


def train_macs(forward_macs: int, samples: int, epochs: int, teacher_macs: int = 0) -> int:
    """MACs of one local training: 3 x forward MACs x samples x epochs (FedScale/FedTrans), plus
    teacher_macs x samples for a teacher's forward pass (or other per-sample work) over the samples (factor 1,
    once per task).
    Raises TypeError/ValueError for non-integer or negative inputs."""
    n = checked_count(samples, "samples")
    student = TRAIN_COST_FACTOR * checked_count(forward_macs, "forward_macs") * n * checked_count(epochs, "epochs")
    return student + checked_count(teacher_macs, "teacher_macs") * n


def compute_seconds(macs: int, profile: DeviceProfile) -> float:
    """Seconds the device takes for `macs` training MACs at its train_macs_per_s (the 3x is already in `macs`,
    see train_macs). Raises TypeError/ValueError for a non-integer or negative `macs`."""
    return checked_count(macs, "macs") / profile.train_macs_per_s


def bytes_down(task: Task) -> int:
    """The task's payload bytes on the wire (fedge.wire.codec.encode_task); an unencodable task raises WireError."""
    return len(encode_task(task))


def bytes_up(result: Result) -> int:
    """The reply's payload bytes on the wire (fedge.wire.codec.encode_result); an unencodable reply raises WireError."""
    return len(encode_result(result))


def task_epochs(task: Task, default: int) -> int:
    """The local epochs a training task asks for (its config's `epochs`, fedge.tasks.TrainTask), else `default`
    (a custom task without that key)."""
    epochs = task.config.get("epochs")
    return epochs if isinstance(epochs, int) and not isinstance(epochs, bool) and epochs >= 0 else default


@dataclass(frozen=True)
class ClientClock:
    """One client's training exchange of one round: bytes each way, their transfer seconds, the compute MACs and
    seconds. Its simulated time is download + compute + upload."""

    bytes_down: int
    bytes_up: int
    down_seconds: float
    up_seconds: float
    train_macs: int
    compute_seconds: float

    @property
    def transfer_seconds(self) -> float:
        """Download plus upload seconds, each with the profile's rtt."""
        return self.down_seconds + self.up_seconds

    @property
    def seconds(self) -> float:
        """The client's simulated time for the round: download, then training, then upload."""
        return self.down_seconds + self.compute_seconds + self.up_seconds

    def fields(self) -> dict[str, Any]:
        """Its metrics.jsonl fields."""
        return {
            "sim_compute_seconds": self.compute_seconds,
            "sim_transfer_seconds": self.transfer_seconds,
            "sim_seconds": self.seconds,
            "bytes_down": self.bytes_down,
            "bytes_up": self.bytes_up,
            "train_macs": self.train_macs,
        }


def client_clock(
    task: Task, result: Result, trained: ModelSpec, epochs: int, profile: DeviceProfile, other_macs: int = 0
) -> ClientClock:
    """The simulated exchange of a client that trained `trained` (Strategy.trained_spec) on result.num_examples
    samples for `epochs` epochs, with the teacher's forward pass when the task carries a "teacher" model (or its
    shipped program: fedge.teacher_program) and `other_macs` per sample of the task's other work over its samples
    (Strategy.other_macs: DC-PFL's pass for the class statistics).
    Raises like train_macs, bytes_down and bytes_up."""
    teacher = task.models.get(C.TEACHER_ROLE)
    spec = teacher.spec if teacher is not None else shipped_spec(task.records)  # or its shipped program's
    once = (spec.macs if spec is not None else 0) + checked_count(other_macs, "other_macs")
    macs = train_macs(trained.macs, result.num_examples, epochs, once)
    down, up = bytes_down(task), bytes_up(result)
    return ClientClock(
        bytes_down=down,
        bytes_up=up,
        down_seconds=transfer_seconds(down, profile, DIRECTION_DOWN),
        up_seconds=transfer_seconds(up, profile, DIRECTION_UP),
        train_macs=macs,
        compute_seconds=compute_seconds(macs, profile),
    )


def round_seconds(client_seconds: list[float], missing: bool, deadline_s: float | None) -> float:
    """A round's simulated time: the slowest client that replied (0 with none); when a selected client never
    replied and the transport has a round deadline, the server waited it out, so at least `deadline_s`.
    In-process runs have no deadline: the slowest client that replied."""
    slowest = max(client_seconds, default=0.0)
    return max(slowest, deadline_s) if missing and deadline_s is not None else slowest


class RunClock:
    """The run's cumulative simulated seconds, training MACs and training-exchange bytes (down + up)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.train_macs = 0
        self.network_bytes = 0

    def close_round(self, clocks: Mapping[str, ClientClock], missing: bool, deadline_s: float | None) -> dict[str, Any]:
        """Advance by one completed round (see round_seconds); returns the round's metrics.jsonl fields."""
        seconds = round_seconds([c.seconds for c in clocks.values()], missing, deadline_s)
        self.seconds += seconds
        self.train_macs += sum(c.train_macs for c in clocks.values())
        self.network_bytes += sum(c.bytes_down + c.bytes_up for c in clocks.values())
        return {
            "round_sim_seconds": seconds,
            "cumulative_sim_seconds": self.seconds,
            "cumulative_train_macs": self.train_macs,
        }

    def state(self) -> Tree:
        """The counters, for the checkpoint."""
        return {"seconds": self.seconds, "train_macs": self.train_macs, "network_bytes": self.network_bytes}

    def load_state(self, tree: Tree | None) -> None:
        """Restore state(); a checkpoint written before the clock existed (None, or missing keys) starts at 0.
        A garbled value raises TypeError or ValueError."""
        tree = {} if tree is None else tree
        if not isinstance(tree, dict):
            raise TypeError(f"the simulated clock's state must be a dict, got {type(tree).__name__}")
        self.seconds = float(tree.get("seconds", 0.0))
        self.train_macs = checked_count(tree.get("train_macs", 0), "train_macs")
        self.network_bytes = checked_count(tree.get("network_bytes", 0), "network_bytes")

    def summary(self) -> dict[str, Any]:
        """Its summary.json fields."""
        return {
            "sim_seconds_total": self.seconds,
            "train_macs_total": self.train_macs,
            "network_bytes_total": self.network_bytes,
        }
