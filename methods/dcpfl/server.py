"""`dcpfl` (Tang et al., IJCAI 2024, Algorithm 1) and `fedgh` (Yi et al., ACM MM 2023): every client keeps its own
feature extractor and all share one classifier head g_φ, which the server trains from per-class feature
statistics; no model and no feature leaves a client.

DC-PFL, each round (Algorithm 1, server lines 2-9):
- send φ^t and the global class means µ_c^t (none in the first round) to the selected clients (line 4); they
  train on L_sup + λ·L_kd and upload per-class counts, means and covariances (methods/dcpfl/client.py);
- refuse an upload whose statistics are impossible before anything is pooled (dcpfl_math.statistics_rejection),
  or whose class means or spreads are beyond STATISTICS_SCALE_FACTOR x the round's (dcpfl_math.scale_rejections),
  so that no accepted reply's means move one step of Eq. (8) much further than an honest one;
- one SGD step of φ per reply, in client order, on that client's class means (line 5, Eqs. 8-9);
- pool the round's statistics per class (line 7, Eqs. 10-11, float64), no client's share of a class above
  `max_client_share`; a class no reply holds keeps its previous global statistics;
- draw Σ|G_c| virtual features from N(µ_c, Σ_c), |G_c| ∝ |D_c| (line 8), and calibrate φ on them (line 9,
  Eq. 12).
Ablations (Table 1): `aux_lambda=0` is "w/o AL", `calibration=false` is "w/o GC".

FedGH, from the same parts: clients train on CE alone (λ = 0) and upload class means (prototypes) and counts; the
server takes one SGD step of the header per (client, class) prototype, in client order (the step the authors' code
meant: theirs calls the last client's optimizer, so the header never trains, original-code-notes §5.2).

Our choices where the papers are silent (docs/deviations.md): clients train with the run's optimizer (Adam at
`lr`, as every fedge strategy; the paper's SGD 0.01 applies to the server's steps, option `server_lr`); λ
(`aux_lambda`) defaults to 0.1 and the calibration to `calibration_steps` full-batch SGD steps; the personalized
model a client is evaluated on is its own extractor with the head as its local training left it (w_k of Eq. 5).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from device_profiles import DeviceProfile, training_footprint_bytes
from fedge import constants as C
from fedge.checkpoint import Tree
from fedge.config import ConfigError
from fedge.model.spec import ModelSpec, build
from fedge.model.weights import load_module
from fedge.seeding import derive_seed
from fedge.wire.messages import ClientInfo, Result, Task, Weights, client_order
from fedge.wire.payloads import Expected, TensorSlot
from methods.dcpfl.class_stats import COUNTS, COVARIANCES, GLOBAL_MEANS, KNOWN_CLASSES, MEANS, ClassStats
from methods.dcpfl.heads import HeadError, head_spec
from methods.dcpfl.maths import (
    calibrate,
    ce_step,
    pool,
    scale_rejections,
    statistics_rejection,
    updated,
    virtual_features,
)
from methods.dcpfl.tasks import DCTrainTask
from server.strategy import Strategy, StrategyError, StrategyOptions, option, register_strategy, torch_profiles

log = logging.getLogger(__name__)
SERVER_LR = 0.01  # η_φ: DC-PFL §6.1 (SGD, 0.01 for local and global classifier training); FedGH's code: 0.01
MAX_VIRTUAL_SAMPLES = 1_000_000  # Σ|G_c| and calibration steps beyond these only exhaust the server
MAX_CALIBRATION_STEPS = 100_000
# Bytes per covariance entry a client holds while it computes and sends its statistics: float64 (class_statistics),
# the float32 copy it uploads, and that copy encoded.
STATISTICS_BYTES_PER_ENTRY = 16


def check_server_lr(lr: float) -> None:
    if not (lr > 0 and math.isfinite(lr)):
        raise ConfigError(f"server_lr must be a finite number > 0, got {lr}")


@dataclass(frozen=True)
class DCPFLOptions(StrategyOptions):
    """λ of Eq. (4), the virtual features and calibration of Eq. (12), and η_φ of Eq. (8)."""

    aux_lambda: float = option(
        0.1, "λ of Eq. (4): weight of the auxiliary loss to the global class means (paper: unreported); 0 = w/o AL"
    )
    calibration: bool = option(True, "global classifier calibration on virtual features (Eq. 12); false = w/o GC")
    virtual_samples: int = option(1000, "Σ|G_c|: virtual features drawn per round, split by class counts (Table 3)")
    calibration_steps: int = option(
        100, "full-batch SGD steps of Eq. (12) on the virtual features each round (paper: unreported)"
    )
    server_lr: float = option(SERVER_LR, "η_φ: the server's SGD learning rate in Eqs. (8) and (12) (paper: 0.01)")
    max_client_share: float = option(
        C.MAX_CLIENT_SHARE,
        "largest share of a class's pooled statistics (Eqs. 10-11) one client may get, in (0, 1]; 1: the paper's",
    )

    def __post_init__(self) -> None:
        if not 0 < self.max_client_share <= 1:
            raise ConfigError(
                f"max_client_share must be in (0, 1] (1: the paper's count weights), got {self.max_client_share}"
            )
        if not (self.aux_lambda >= 0 and math.isfinite(self.aux_lambda)):
            raise ConfigError(
                f"aux_lambda must be a finite number >= 0 (0: the w/o AL ablation), got {self.aux_lambda}"
            )
        if not (
            1 <= self.virtual_samples <= MAX_VIRTUAL_SAMPLES and 1 <= self.calibration_steps <= MAX_CALIBRATION_STEPS
        ):
            raise ConfigError(
                f"virtual_samples must be in 1..{MAX_VIRTUAL_SAMPLES:,} and calibration_steps in "
                f"1..{MAX_CALIBRATION_STEPS:,} (calibration=false skips Eq. 12), got {self.virtual_samples} and "
                f"{self.calibration_steps}"
            )
        check_server_lr(self.server_lr)


class SharedHead(Strategy):
    """What DC-PFL and FedGH share: a fleet of extractors with one head shape, the global head φ, the `dc_train`
    task and the checks of its statistics. Subclasses say what the clients upload and how φ learns from it."""

    covariance = True  # whether clients upload class covariances

    def setup(self, clients: Mapping[str, ClientInfo]) -> None:
        super().setup(clients)
        order = sorted(clients, key=client_order)
        profiles = torch_profiles(
            self.name, clients, "trains through the dc_train task (an auxiliary loss, statistics)"
        )
        heads: dict[str, list[str]] = {}  # a head's spec as JSON -> the clients with it
        for cid in order:
            try:
                heads.setdefault(head_spec(clients[cid].spec).to_json(), []).append(cid)
            except HeadError as e:
                raise StrategyError(f"{self.name}: client {cid}: {e}") from None
        if len(heads) > 1:
            specs = [(ModelSpec.from_json(key), ids) for key, ids in heads.items()]  # a spec is not hashable
            groups = "; ".join(
                f"clients {ids} have a {spec.input_shape[0]}-d representation and head "
                f"{[layer.to_dict() for layer in spec.blocks[0].layers]}"
                for spec, ids in specs
            )
            raise StrategyError(
                f"{self.name} shares one classifier head, but this fleet's heads differ: {groups}. Use models whose "
                "last block is the same linear layer on the same representation (e.g. --zoo fedgh)"
            )
        self.head_spec = ModelSpec.from_json(next(iter(heads)))
        self.d, self.num_classes = self.head_spec.input_shape[0], self.head_spec.num_classes
        self.check_memory(clients, profiles, order)
        torch.manual_seed(derive_seed(self.config.seed, f"{self.name}-init"))
        self.head = Weights(self.head_spec, build(self.head_spec).state_dict())
        self.uploaded: dict[str, int] = {}  # client -> classes its accepted reply held, this round

    def check_memory(
        self, clients: Mapping[str, ClientInfo], profiles: Mapping[str, DeviceProfile], order: Sequence[str]
    ) -> None:
        """StrategyError naming the clients whose device memory cannot hold their training footprint (Adam: the
        runtime is torch) plus the class covariances they compute and send (C·d² entries, STATISTICS_BYTES_PER_ENTRY
        bytes each)."""
        if not self.covariance:
            return
        extra = STATISTICS_BYTES_PER_ENTRY * self.num_classes * self.d**2
        over = []
        for cid in order:
            info = clients[cid]
            training = training_footprint_bytes(info.spec, min(self.config.batch_size, max(info.num_train, 1))).total
            if training + extra > profiles[cid].memory_bytes:
                over.append(cid)
        if over:
            raise StrategyError(
                f"{self.name}: clients {over} cannot hold their {self.num_classes} class covariances "
                f"({extra / 1e6:.0f} MB while computing and sending them, {self.num_classes} x {self.d}² entries) "
                "beside their training footprint in their device profile's memory_bytes; use a model with a smaller "
                "representation or a device with more memory"
            )

    def task_config(self) -> dict[str, Any]:
        """The dc_train config: the run's local training, λ and whether to upload covariances."""
        settings = self.train_task(False, DCTrainTask, aux_lambda=self.aux_lambda(), covariance=self.covariance)
        return settings.to_config()

    def aux_lambda(self) -> float:
        """λ of the clients' Eq. (4); 0 unless the strategy sends global means."""
        return 0.0

    def task_tensors(self) -> dict[str, torch.Tensor]:
        """Named tensors the dc_train task carries besides the head; none by default."""
        return {}

    def plan(self, rnd: int, active: Sequence[str]) -> dict[str, Task]:
        self.uploaded = {}
        config, tensors = self.task_config(), self.task_tensors()
        return {cid: Task("dc_train", rnd, config, {"head": self.head}, tensors) for cid in active}

    def expects(self, task: Task, client: ClientInfo) -> Expected:
        """A dc_train reply carries the class means (C, d), counts (C,) and, when asked, covariances (C, d, d);
        no model."""
        if task.type != "dc_train":
            return Expected()
        c, d = self.num_classes, self.d
        tensors = {MEANS: TensorSlot((c, d)), COUNTS: TensorSlot((c,), "int64")}
        if self.covariance:
            tensors[COVARIANCES] = TensorSlot((c, d, d))
        return Expected(tensors=tensors)

    def other_macs(self, task: Task, client: ClientInfo) -> int:
        """The statistics of a dc_train task, per training sample: one forward pass of the client's model (its
        extractor gives z; the head's few MACs included) and, with covariances, z zᵀ's d² multiply-adds."""
        if task.type != "dc_train":
            return 0
        return client.spec.macs + (self.d**2 if self.covariance else 0)

    def reply_rejection(self, task: Task, client: ClientInfo, result: Result) -> tuple[str, str] | None:
        """Counts that sum to the reply's example count (bounded by the client's registration), entries of sane
        magnitude, covariances symmetric and positive semi-definite (dcpfl_math.statistics_rejection)."""
        if task.type != "dc_train":
            return None
        return statistics_rejection(self.stats_of(result), result.num_examples)

    def round_rejections(self, tasks: Mapping[str, Task], results: Mapping[str, Result]) -> dict[str, tuple[str, str]]:
        """The dc_train replies whose class mean norms or spreads are beyond STATISTICS_SCALE_FACTOR x the round's
        (dcpfl_math.scale_rejections; with fewer than STATISTICS_MIN_REPLIES replies, against `known_statistics`),
        refused as `statistics_scale`."""
        replies = {
            cid: self.stats_of(res)
            for cid, res in results.items()
            if cid in tasks and tasks[cid].type == "dc_train" and res.type == "dc_train"
        }
        return scale_rejections(replies, self.known_statistics()) if replies else {}

    def known_statistics(self) -> ClassStats | None:
        """The server's own statistics per class, the reference of a round too small for a median; none here."""
        return None

    def stats_of(self, result: Result) -> ClassStats:
        """A checked reply's statistics."""
        t = result.tensors
        return ClassStats(t[COUNTS], t[MEANS], t.get(COVARIANCES))

    def replies(self, results: Mapping[str, Result]) -> list[tuple[str, ClassStats]]:
        """The dc_train replies in client order, as statistics; records how many classes each held."""
        out = [
            (cid, self.stats_of(results[cid]))
            for cid in sorted(results, key=client_order)
            if results[cid].type == "dc_train"
        ]
        self.uploaded = {cid: int((s.counts > 0).sum()) for cid, s in out}
        return out

    def aggregate(self, rnd: int, results: Mapping[str, Result]) -> None:
        """Train the global head on the round's statistics (train_head), if any reply came. The steps run the head
        in eval mode (dcpfl_math.ce_step): a head's dropout draws nothing, so a round aggregates the same however
        the process got there (a resumed run included)."""
        replies = self.replies(results)
        if not replies:
            return
        head = self.head_module()
        self.train_head(rnd, head, replies)
        self.keep_head(head)

    def train_head(self, rnd: int, head: torch.nn.Module, replies: Sequence[tuple[str, ClassStats]]) -> None:
        """Update `head` (φ) in place from the round's replies (client order, at least one)."""
        raise NotImplementedError

    def head_module(self) -> torch.nn.Module:
        """The global head as a module; building it leaves the process's global RNG as it was."""
        with torch.random.fork_rng(devices=[]):
            return load_module(self.head.spec, self.head.state)

    def keep_head(self, module: torch.nn.Module) -> None:
        self.head = Weights(self.head.spec, {k: v.detach().clone() for k, v in module.state_dict().items()})

    def record(self, rnd: int, client: str) -> dict[str, Any]:
        """How many classes the client's statistics held this round."""
        return {"classes_uploaded": self.uploaded[client]} if client in self.uploaded else {}

    def summary(self) -> dict[str, Any]:
        return {"representation_size": self.d, "head": self.head.spec.blocks[0].layers[-1].to_dict()}

    def state(self) -> Tree:
        return {"head": self.head}

    def load_state(self, state: Tree) -> None:
        """Take the checkpoint's head; one of another shape raises StrategyError."""
        head = state["head"]
        if head.spec != self.head.spec:
            raise StrategyError(f"checkpoint holds a head for {head.spec.input_shape}, this fleet's is {self.d}-d")
        self.head = head


@register_strategy("dcpfl", DCPFLOptions)
class DCPFL(SharedHead):
    """Algorithm 1: Eq. (8) per reply, Eqs. (10)-(11) pooling, Eq. (12) calibration on Gaussian virtual
    features; the global class means go back to the clients for L_kd (Eq. 3)."""

    def setup(self, clients: Mapping[str, ClientInfo]) -> None:
        super().setup(clients)
        c, d = self.num_classes, self.d
        # The global statistics per class; a class no reply has held yet has count 0.
        self.stats = ClassStats(
            torch.zeros(c, dtype=torch.int64),
            torch.zeros(c, d, dtype=torch.float64),
            torch.zeros(c, d, d, dtype=torch.float64),
        )

    def aux_lambda(self) -> float:
        return self.options.aux_lambda

    def known_statistics(self) -> ClassStats | None:
        """The global statistics (a class with count 0 has none)."""
        return self.stats

    def task_tensors(self) -> dict[str, torch.Tensor]:
        """The global class means µ_c^t and which classes have one; none before any statistics (the first round,
        where clients train on L_sup alone) or with λ = 0."""
        known = self.stats.counts > 0
        if self.options.aux_lambda == 0 or not bool(known.any()):
            return {}
        return {GLOBAL_MEANS: self.stats.means.float(), KNOWN_CLASSES: known}

    def train_head(self, rnd: int, head: torch.nn.Module, replies: Sequence[tuple[str, ClassStats]]) -> None:
        for _, s in replies:  # Algorithm 1 line 5: Eq. (8) once per client, in turn, on its class means (Eq. 9)
            held = torch.nonzero(s.counts > 0).flatten()
            ce_step(head, s.means[held], held, self.options.server_lr)
        # line 7: Eqs. (10)-(11), shares capped
        pooled = pool([s for _, s in replies], self.num_classes, self.options.max_client_share)
        self.stats = updated(self.stats, pooled)
        if self.options.calibration:  # lines 8-9: virtual features from N(µ_c, Σ_c), Eq. (12)
            gen = torch.Generator().manual_seed(derive_seed(self.config.seed, "dcpfl-virtual", rnd))
            z, y = virtual_features(self.stats, self.options.virtual_samples, gen)
            losses = calibrate(head, z, y, self.options.calibration_steps, self.options.server_lr)
            log.info(
                "round %d: calibration loss (Eq. 12) %.4f -> %.4f on %d virtual features",
                rnd,
                losses[0],
                losses[-1],
                len(y),
            )

    def summary(self) -> dict[str, Any]:
        known = self.stats.counts > 0
        return super().summary() | {"classes_with_statistics": int(known.sum())}

    def state(self) -> Tree:
        """The head and the global statistics of every class."""
        s = self.stats
        return super().state() | {"counts": s.counts, "means": s.means, "covariances": s.covariances}

    def load_state(self, state: Tree) -> None:
        super().load_state(state)
        s = self.stats
        if any(
            tuple(state[k].shape) != tuple(mine.shape) or state[k].dtype != mine.dtype
            for k, mine in (("counts", s.counts), ("means", s.means), ("covariances", s.covariances))
        ):
            raise StrategyError(f"checkpoint statistics do not fit {self.num_classes} classes x {self.d}-d")
        self.stats = ClassStats(state["counts"], state["means"], state["covariances"])
