"""What pFedClub and pFedHR share: KD tasks with kept teachers, block features → CKA → groups, fine-tuning,
matching, and the per-client records (teacher size, ϕ of pFedClub Eq. (6), server time by stage)."""

from __future__ import annotations

import itertools
import logging
import os
import statistics
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

import torch
from torch import nn

from device_profiles import fits, get_profile
from fedge import constants as C
from fedge.checkpoint import Tree
from fedge.config import ConfigError
from fedge.model.weights import load_module
from fedge.seeding import derive_seed
from fedge.teacher_program import TEACHER_PROGRAM_ERROR, TEACHER_PTE_SHA256
from fedge.wire.messages import ClientInfo, Result, Task, Weights, client_order
from fedge.wire.payloads import Expected
from methods.reassembly.assemble import STITCH_MODEL
from methods.reassembly.blocks import Key, PoolBlock, split_blocks
from methods.reassembly.cka import block_similarity, minibatch_block_similarity
from methods.reassembly.fastblocks import fold_batchnorm
from methods.reassembly.features import block_features
from methods.reassembly.finetune import FinetuneConfig, Tuned, finetune_candidates
from methods.reassembly.grouping import group_blocks
from methods.reassembly.teacher_programs import ProgramExporter, TeacherPrograms
from server.strategy import PublicData, Strategy, StrategyError, StrategyOptions, option

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")
STAGES = ("features", "grouping", "candidates", "finetune", "matching")


def block_kind(block: PoolBlock) -> int:
    """0: feature map → feature map, 1: map → vector, 2: vector → vector, 3: vector → map."""
    return 2 * (len(block.spec.in_shape) == 1) + (len(block.spec.in_shape) != len(block.spec.out_shape))


class Pool:
    """One round's uploaded blocks with their functional groups (pFedClub §3.2.1) and Eq. (1) similarities; each
    upload's logits on the public data when the feature pass kept them; each block's frozen module for candidates
    (built once per block on `device`, BatchNorm folded: `frozen`)."""

    def __init__(
        self,
        uploads: Mapping[str, Weights],
        similarity: torch.Tensor,
        labels: torch.Tensor,
        logits: Mapping[str, torch.Tensor] | None = None,
        device: str = "cpu",
    ) -> None:
        self.uploads = dict(uploads)
        self.blocks: dict[Key, PoolBlock] = {b.key: b for cid, w in uploads.items() for b in split_blocks(cid, w)}
        self.index = {key: i for i, key in enumerate(self.blocks)}
        self.similarity = similarity
        self.groups = {key: int(labels[i]) for key, i in self.index.items()}
        self.logits = dict(logits or {})
        self.device = device
        self.fold = True  # frozen modules with BatchNorm folded and channels-last (pFedClub's `fold_frozen`)
        self._frozen: dict[Key, nn.Module] = {}

    def build_frozen(self) -> None:
        """Build every block's frozen module now (`frozen` builds them on first use, which workers must not race)."""
        for cid in self.uploads:
            self.frozen(self.blocks[(cid, 0)])

    def frozen(self, block: PoolBlock) -> nn.Module:
        """The pool block as a frozen module for candidates: eval mode, no grad and, with `fold`, BatchNorm folded into
        the layer before it and convolutions channels-last (`fold_batchnorm`; equal to the block up to float
        rounding, and never what a teacher's weights are taken from); one per block, built from its upload's module
        on first use."""
        if block.key not in self._frozen:
            module = load_module(self.uploads[block.client].spec, self.uploads[block.client].state, self.device)
            for i, b in enumerate(module.blocks):
                frozen = fold_batchnorm(b.eval(), channels_last=True) if self.fold else b.eval().requires_grad_(False)
                self._frozen[(block.client, i)] = frozen
        return self._frozen[block.key]

    @cached_property
    def kind_groups(self) -> dict[Key, int]:
        """The K-means groups split by block kind (block_kind), as pFedClub's CMSR uses them.

        Deviation: CMSR substitutes a block only by one of its own kind. CKA groups of K = 4 mix kinds
        (seen on zoo I), and a cross-kind substitution needs a flattened linear stitch of up to millions
        of weights, which the issue forbids (stitches must stay small).
        """
        return {key: 4 * label + block_kind(self.blocks[key]) for key, label in self.groups.items()}

    def sim(self, a: Key, b: Key) -> float:
        return float(self.similarity[self.index[a], self.index[b]])


def origins(spec_blocks: Sequence[Any]) -> list[str]:
    """Readable block origins of a teacher: "cnn1@3:2" = block 2 of client 3's cnn1; stitches as "stitch"."""
    return [
        STITCH_MODEL if b.origin.model == STITCH_MODEL else f"{b.origin.model}@{b.origin.client}:{b.origin.block}"
        for b in spec_blocks
    ]


@dataclass(frozen=True)
class ReassemblyOptions(StrategyOptions):
    """What pFedClub and pFedHR share: functional groups, the public data's use, distillation and fine-tuning."""

    clusters: int = option(C.CLUSTERS, "functional groups K of the uploaded blocks (pFedClub §4.1: 4)")
    public: str = option(
        "labeled",
        "the server's public data: labeled (stitches tuned by CE, Eq. (2)) or "
        "unlabeled (NT-Xent on two augmented views, Eq. (3))",
    )
    kd_lambda: float = option(C.KD_LAMBDA, "λ of the clients' CE + λ·KL distillation (Eq. (5); paper: 0.2)")
    kd_direction: str = option(
        C.KD_DIRECTION,
        "the KL of Eq. (5): teacher_student = KL(teacher ‖ student), the teacher's distribution as the target "
        "(Deep Mutual Learning [36] and the authors' code), or student_teacher = KL(student ‖ teacher), "
        "Eq. (5) read literally",
    )
    finetune_epochs: int = option(C.FINETUNE_EPOCHS, "epochs of stitch fine-tuning on the public data (paper: 3)")
    finetune_min_steps: int = option(
        C.FINETUNE_MIN_STEPS,
        "floor on the server's fine-tuning optimiser steps, reached with batches down to the authors' 8 on a small "
        "public set (225: the paper's 3 epochs over its 4,800-sample public set at batch 64; 0: epochs only)",
    )

    def __post_init__(self) -> None:
        for name in ("clusters", "finetune_epochs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.finetune_min_steps < 0:
            raise ConfigError(f"finetune_min_steps must be 0 (none) or positive, got {self.finetune_min_steps}")
        if not self.kd_lambda >= 0:
            raise ConfigError(f"kd_lambda must be >= 0, got {self.kd_lambda}")
        if self.public not in ("labeled", "unlabeled"):
            raise ConfigError(f"public must be labeled or unlabeled, got {self.public!r}")
        if self.kd_direction not in C.KD_DIRECTIONS:
            raise ConfigError(f"kd_direction must be one of {', '.join(C.KD_DIRECTIONS)}, got {self.kd_direction!r}")


def _histogram_sum(histograms: Iterator[list[int] | None]) -> list[int] | None:
    """Bin-wise sum of histograms of different lengths (None entries skipped; None if all are)."""
    total: list[int] | None = None
    for h in histograms:
        if h is not None:
            total = [a + b for a, b in itertools.zip_longest(total or [], h, fillvalue=0)]
    return total


def _finite_features(weights: Weights, x: torch.Tensor, device: str) -> bool:
    """Whether every block's input and output features on `x` are finite (checked a CKA minibatch at a time)."""
    for xb in torch.split(x, C.CKA_MINIBATCH_SIZE):
        feats = block_features(weights, xb, device=device)
        if not all(bool(torch.isfinite(f.outputs).all()) for f in feats):
            return False
    return True


class ReassemblyStrategy(Strategy):
    """Base of the block-reassembly strategies; subclasses implement `make_teachers`.

    `program_for` (set by the launcher before `setup`; None: executorch clients get the teacher's weights) exports
    a teacher's parity-checked XNNPACK inference program; an executorch client's kd_train task then ships that
    program (methods.reassembly.teacher_programs, exported once per distinct teacher) instead of the weights."""

    program_for: ProgramExporter | None = None

    def setup(self, clients: Mapping[str, ClientInfo]) -> None:
        super().setup(clients)
        if self.public is not None and self.options.public == "unlabeled":  # stitches learn from views, not labels
            self.public = PublicData(self.public.x, None)
        if self.public is None or len(self.public.x) < C.MIN_PUBLIC_SAMPLES:
            have = 0 if self.public is None else len(self.public.x)
            raise StrategyError(
                f"{self.name} needs at least {C.MIN_PUBLIC_SAMPLES} public samples on the server, "
                f"got {have}; raise max_public_samples or use a larger dataset"
            )
        self.teachers: dict[str, Weights] = {}
        self.sent: set[str] = set()
        self.profiles = {cid: get_profile(info.profile) for cid, info in clients.items()}
        self.rows: dict[tuple[int, str], dict[str, Any]] = {}
        self.history: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.times: dict[str, float] = {}
        self._times_lock = threading.Lock()
        # one server thread per core the torch threads leave: `fedge run` gives its server one torch thread
        self.workers = max(1, (os.cpu_count() or 1) // torch.get_num_threads())
        # executorch clients get their teacher as an XNNPACK program exported here (when the launcher gave an exporter)
        self.programs = None if self.program_for is None else TeacherPrograms(self.program_for)
        self.program_errors: dict[tuple[int, str], str] = {}  # why a client's task went without its teacher

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Accumulate wall time of one server stage for the current round (summed over `parallel`'s workers)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            with self._times_lock:
                self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start

    def parallel(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        """fn over items on `workers` threads, results in item order (the first exception raised is re-raised).

        Each item's work must be independent, seeded by itself and never touch torch's global generator (pFedHR's
        whole-model fine-tuning draws dropout from it, so it stays serial); with one torch intra-op thread per
        worker the results do not depend on the number of workers (torch releases the GIL inside its kernels,
        so workers use as many cores)."""
        if self.workers <= 1 or len(items) <= 1:
            return [fn(item) for item in items]
        with ThreadPoolExecutor(min(self.workers, len(items)), thread_name_prefix=f"{self.name}-server") as pool:
            return list(pool.map(fn, items))

    def plan(self, rnd: int, active: Sequence[str]) -> dict[str, Task]:
        """kd_train for every active client, with the teacher kept from its last selection (pFedClub §3.3)."""
        kd = {"kd_lambda": self.options.kd_lambda, "kd_direction": self.options.kd_direction}
        config = self.train_task(upload=True, **kd).to_config()
        self.sent = set(active)
        tasks = {}
        for cid in active:
            teacher = self.teachers.get(cid)
            if teacher is None:
                tasks[cid] = Task("kd_train", rnd, config)
            elif self.programs is not None and self.profiles[cid].runtime == "executorch":
                tasks[cid] = self.programs.task(rnd, config, teacher)  # its program, not its weights
                if TEACHER_PROGRAM_ERROR in tasks[cid].records:
                    self.program_errors[(rnd, cid)] = tasks[cid].records[TEACHER_PROGRAM_ERROR]
            else:
                tasks[cid] = Task("kd_train", rnd, config, {C.TEACHER_ROLE: teacher})
        if self.programs is not None:
            self.programs.keep_only(self.teachers[c] for c in active if c in self.teachers)
        return tasks

    def expects(self, task: Task, client: ClientInfo) -> Expected:
        """A kd_train reply carries the client's own model (its registered architecture) and, from a client that
        ran a shipped teacher program, that program's SHA-256; an evaluation metrics."""
        if task.type != "kd_train":
            return Expected()
        ran = frozenset({TEACHER_PTE_SHA256})
        return Expected(models={"local": client.spec}, records=tuple(ran), optional=ran)

    def aggregate(self, rnd: int, results: Mapping[str, Result]) -> None:
        """Group the uploaded blocks, then build, fine-tune and match each uploader's teacher."""
        uploads = {cid: results[cid].models["local"] for cid in sorted(results) if "local" in results[cid].models}
        self.times = dict.fromkeys(STAGES, 0.0)
        for cid in self.sent - set(uploads):  # its teacher was delivered (or broke it): build a new one next time
            if self.teachers.pop(cid, None) is not None:
                log.info("round %d: client %s did not reply; its teacher is dropped", rnd, cid)
        pool, left_out = self.pool(rnd, uploads) if uploads else (None, [])
        teachers: dict[str, tuple[Weights | None, dict[str, Any]]] = {}
        if pool is not None:
            try:
                teachers = self.make_teachers(rnd, pool)
            except (ValueError, RuntimeError) as e:  # e.g. a diverged fine-tuning: the round goes on without teachers
                log.error("round %d: no new teachers, building them failed: %s", rnd, e)
                teachers = {cid: (None, {"candidates": 0, "teacher_error": str(e)}) for cid in pool.uploads}
        for cid in left_out:
            teachers[cid] = (
                None,
                {"candidates": 0, "teacher_error": "its block outputs on the public data are not finite"},
            )
        for cid, (teacher, info) in teachers.items():
            self.keep(rnd, cid, uploads[cid], teacher, info)
        for cid in uploads:
            self.rows.setdefault((rnd, cid), {}).update({f"time_{s}": self.times[s] for s in STAGES})
            ran = results[cid].records.get(TEACHER_PTE_SHA256)
            if ran is not None:  # the teacher program the client ran (the one this round's task shipped)
                self.rows[(rnd, cid)][TEACHER_PTE_SHA256] = ran

    def pool(self, rnd: int, uploads: Mapping[str, Weights]) -> tuple[Pool | None, list[str]]:
        """Block features on public data → Eq. (1) similarity of all block pairs → K functional groups; and the
        uploads left out. Weights that are finite but huge (a device may send them) give Inf or NaN features, which
        would make Eq. (1) undefined for the whole pool: such an upload is left out of this round's pool (its client
        gets no teacher), the others go on (None: none is left). One feature pass per upload: it gives the
        finiteness check, Eq. (1)'s features and the upload's logits (its last block's outputs)."""
        device, x = self.config.device, self.public.x
        with self.stage("features"):
            if len(x) <= C.CKA_FULL_MAX_SAMPLES:
                feats = {cid: block_features(w, x, device=device) for cid, w in uploads.items()}
                bad = [cid for cid, fs in feats.items() if not all(bool(torch.isfinite(f.outputs).all()) for f in fs)]
                ok = {cid: w for cid, w in uploads.items() if cid not in bad}
                similarity = block_similarity([f for cid in ok for f in feats[cid]], device=device) if ok else None
                logits = {cid: feats[cid][-1].outputs for cid in ok}
            else:  # too many public samples to keep every block's features: unbiased minibatch CKA
                bad = [cid for cid, w in uploads.items() if not _finite_features(w, x, device)]
                ok = {cid: w for cid, w in uploads.items() if cid not in bad}
                parts = -(-len(x) // C.CKA_MINIBATCH_SIZE)  # equal parts: no tiny tail batch
                batches = (
                    [f for w in ok.values() for f in block_features(w, xb, device=device)]
                    for xb in torch.tensor_split(x, parts)
                )
                similarity = minibatch_block_similarity(batches, device=device) if ok else None
                logits = {}
        for cid in bad:
            log.error("round %d: client %s's model gives non-finite outputs on the public data; left out", rnd, cid)
        if similarity is None:
            return None, bad
        with self.stage("grouping"):
            labels = group_blocks(similarity, self.options.clusters, seed=derive_seed(self.config.seed, "group", rnd))
        return Pool(ok, similarity, labels, logits, device), bad

    def make_teachers(self, rnd: int, pool: Pool) -> dict[str, tuple[Weights | None, dict[str, Any]]]:
        """Each uploader's new teacher (None: no valid teacher this time) and what to record about it."""
        raise NotImplementedError

    def finetune_config(self, *tag: object) -> FinetuneConfig:
        """The server's fine-tuning settings (epochs, step floor, lr, τ; CE if the public data are labeled, NT-Xent
        otherwise), seeded by the run seed and `tag`."""
        return FinetuneConfig(
            epochs=self.options.finetune_epochs,
            lr=C.DEFAULT_LR,
            tau=C.NT_XENT_TAU,
            labeled=self.public.y is not None,
            seed=derive_seed(self.config.seed, *tag) % 2**31,
            min_steps=self.options.finetune_min_steps,
        )

    def finetune(self, rnd: int, tag: str, candidates: Sequence[tuple[Weights, tuple[int, ...]]]) -> list[Tuned]:
        """Train only the stitches on public data: CE if labeled (Eq. (2)), NT-Xent otherwise (Eq. (3))."""
        cfg = self.finetune_config("finetune", rnd, tag)
        with self.stage("finetune"):
            return finetune_candidates(candidates, self.public.x, self.public.y, cfg, self.config.device)

    def keep(self, rnd: int, cid: str, own: Weights, teacher: Weights | None, info: dict[str, Any]) -> None:
        """Store the teacher until the client is next selected, and its record (ϕ term of Eq. (6))."""
        row: dict[str, Any] = dict(info)
        if teacher is None:
            self.teachers.pop(cid, None)
            row |= {"teacher_params": None}
        else:
            self.teachers[cid] = teacher
            spec = teacher.spec
            row |= {
                "teacher_params": spec.params,
                "teacher_macs": spec.macs,
                "teacher_origins": origins(spec.blocks),
                "teacher_fits_profile": fits(spec, self.profiles[cid]).ok,
                "phi": (spec.params - own.spec.params) / own.spec.params,
            }
            self.history[cid].append(dict(row))  # a copy: the row gets this round's stage times, history does not
        self.rows[(rnd, cid)] = row

    def record(self, rnd: int, client: str) -> dict[str, Any]:
        """This round's teacher fields for the client (asked once per row, so it is handed over and dropped)."""
        row = self.rows.pop((rnd, client), {})
        error = self.program_errors.pop((rnd, client), None)
        return row if error is None else row | {TEACHER_PROGRAM_ERROR: error}

    def summary(self) -> dict[str, Any]:
        """Per client: ϕ (Eq. (6): mean over the rounds it got a teacher), ϕ without the fallback rounds (own model
        as teacher, ϕ = 0; None if every round was one), how many rounds fell back and how many teachers were the
        client's own model, mean teacher size, mean candidates kept and (pFedClub) generated, and (pFedClub) the kept
        candidates' mean own-block share and their histogram of foreign blocks per candidate over all rounds."""

        def mean(rows: list[dict[str, Any]], key: str) -> float | None:
            values = [r[key] for r in rows if r.get(key) is not None]
            return statistics.fmean(values) if values else None

        cids = sorted(self.history, key=client_order)
        rows = {c: self.history[c] for c in cids}
        searched = {c: [r for r in rows[c] if not r.get("teacher_fallback")] for c in cids}
        return {
            "phi": {c: mean(rows[c], "phi") for c in cids},
            "phi_without_fallback": {c: mean(searched[c], "phi") for c in cids},
            "fallback_rounds": {c: sum(bool(r.get("teacher_fallback")) for r in rows[c]) for c in cids},
            "teacher_is_self_rounds": {c: sum(bool(r.get("teacher_is_self")) for r in rows[c]) for c in cids},
            "teacher_params": {c: mean(rows[c], "teacher_params") for c in cids},
            "candidates_per_client": {c: mean(rows[c], "candidates") for c in cids},
            "candidates_generated_per_client": {c: mean(rows[c], "candidates_total") for c in cids},
            "own_block_share": {c: mean(rows[c], "own_block_share") for c in cids},
            "foreign_blocks": {c: _histogram_sum(r.get("foreign_blocks") for r in rows[c]) for c in cids},
        } | self.program_counts()

    def program_counts(self) -> dict[str, Any]:
        """How many teacher programs the server exported for executorch clients, and how many tasks reused one."""
        if self.programs is None:
            return {}
        return {"teacher_programs_exported": self.programs.exports, "teacher_program_reuses": self.programs.hits}

    def final_models(self) -> dict[str, dict[str, Weights]]:
        """Each client's kept teacher (the one it would get at its next selection)."""
        return {cid: {"teacher": self.teachers[cid]} for cid in sorted(self.teachers, key=client_order)}

    def state(self) -> Tree:
        """The kept teachers and each client's teacher records (what ϕ of Eq. (6) is averaged over)."""
        return {"teachers": dict(self.teachers), "history": {cid: list(rows) for cid, rows in self.history.items()}}

    def load_state(self, state: Tree) -> None:
        """Take the checkpoint's teachers and records; a client outside this fleet raises StrategyError."""
        unknown = (set(state["teachers"]) | set(state["history"])) - set(self.clients)
        if unknown:
            raise StrategyError(f"checkpoint has teachers of clients {sorted(unknown)} that this fleet lacks")
        self.teachers = dict(state["teachers"])
        self.history = defaultdict(list, {cid: list(rows) for cid, rows in state["history"].items()})
