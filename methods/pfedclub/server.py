"""pFedClub and pFedClub+ (NeurIPS 2024): CMSR candidates per client, stitched, fine-tuned, matched."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np

from device_profiles import DeviceProfile, fits, within_size_bound
from fedge import constants as C
from fedge.config import ConfigError
from fedge.model.spec import ModelSpec
from fedge.seeding import derive_seed
from fedge.wire.messages import Weights
from methods.pfedclub.cmsr import Candidate, CmsrOptions, CmsrResult, Prune, cmsr_search, composition
from methods.reassembly.assemble import assemble_modules, assembled_weights, size_problems, stitched_blocks
from methods.reassembly.fastblocks import FastBlocks
from methods.reassembly.finetune import best_match, module_logits, public_logits, train_stitch_modules
from methods.reassembly.strategy import Pool, ReassemblyOptions, ReassemblyStrategy
from server.strategy import StrategyError, option, register_strategy

Accept = Callable[[Candidate], bool]

log = logging.getLogger(__name__)

# pFedClub Table 3 ablations → CMSR switches (the paper's _max, _min, _noc, _nbc).
ABLATION_OPTIONS: dict[str, dict[str, Any]] = {
    "none": {},
    "max": {"anchor": "max"},
    "min": {"anchor": "min"},
    "noc": {"order_constraint": False},
    "nbc": {"completion": False},
}


@dataclass(frozen=True)
class PFedClubOptions(ReassemblyOptions):
    """pFedClub's options: the shared ones, plus the Table 3 ablations and how CMSR compares block positions."""

    ablation: str = option("none", f"pFedClub Table 3 ablation: {', '.join(C.ABLATIONS)}")
    cmsr_index: str = option(
        C.CMSR_INDEX,
        "CMSR's order constraint on raw block indices (raw, Alg. 1) or on "
        "index/depth (relative, for zoos of very different depths)",
    )
    max_candidates: int = option(
        C.MAX_CANDIDATES,
        "0: every CMSR candidate (Alg. 1; up to tens of thousands per client); k: k of them drawn uniformly, "
        "seeded, so the kept ones are composed as the whole set is (a cap for time and memory, not in the paper)",
    )
    fold_frozen: bool = option(
        True,
        "run candidates' frozen blocks with BatchNorm folded into the convolution before it and channels-last: "
        "1.12x on Zoo I, equal per operation up to float rounding, which 225 Adam steps amplify (Eq. (4) scores "
        "up to 1.6e-2 apart, the same teacher for 5 of 5 clients measured); false: the blocks as uploaded",
    )
    lockstep: bool = option(
        False,
        "fine-tune and match a client's candidates in lockstep: a frozen block several of them hold (among those "
        "sharing the blocks before their first stitch, per chunk of 32) runs once on their inputs concatenated, one "
        "backward for all, so all their graphs are held at once (for GPUs, where many small kernels cost launches; "
        "unmeasured there). The same operations per sample; kernels picked for the larger batch round differently "
        "on CPU for MobileNet blocks, so results can differ in the last bits",
    )
    exclude_self: bool = option(
        False,
        "drop the candidate identical to the client's own model (it wins Eq. (4) with cosine 1 when it exists); "
        "when no other candidate is left the client gets no teacher that round",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_candidates < 0:
            raise ConfigError(f"max_candidates must be 0 (all) or a positive integer, got {self.max_candidates}")
        if self.ablation not in C.ABLATIONS:
            raise ConfigError(f"ablation must be one of {', '.join(C.ABLATIONS)}, got {self.ablation!r}")
        if self.cmsr_index not in ("raw", "relative"):
            raise ConfigError(
                f"cmsr_index must be raw (Alg. 1) or relative (position / depth), got {self.cmsr_index!r}"
            )


@dataclass(frozen=True)
class PFedClubPlusOptions(PFedClubOptions):
    """pFedClub+ adds the size bound η of §4.4."""

    eta: float = option(
        C.PFEDCLUB_PLUS_ETA,
        "size bound: a teacher has at most (1+eta)x the client's parameters (§4.4: 0.1; any eta > -1)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.eta > -1:
            raise ConfigError(f"eta must be > -1 (pFedClub §4.4), got {self.eta}")


@register_strategy("pfedclub", PFedClubOptions)
class PFedClub(ReassemblyStrategy):
    """Per client: CMSR (Alg. 1) → stitched candidates → stitch fine-tuning (Eq. 2/3) → matching (Eq. 4)."""

    size_bound = False

    def setup(self, clients: Any) -> None:
        super().setup(clients)
        try:
            self.cmsr = CmsrOptions(index=self.options.cmsr_index, **ABLATION_OPTIONS[self.options.ablation])
        except ValueError as e:
            raise StrategyError(str(e)) from None

    def make_teachers(self, rnd: int, pool: Pool) -> dict[str, tuple[Weights | None, dict[str, Any]]]:
        """Each uploader's teacher, clients on `parallel`'s workers; a client whose candidates fail (e.g. diverge)
        gets none, the others go on."""
        groups = {
            "groups": len(set(pool.groups.values())),
            "groups_after_kind_split": len(set(pool.kind_groups.values())),
        }

        def one(cid: str) -> tuple[Weights | None, dict[str, Any]]:
            try:
                teacher, info = self.teacher_for(rnd, cid, pool)
            except (ValueError, RuntimeError) as e:
                log.error("round %d client %s: no teacher this round, building it failed: %s", rnd, cid, e)
                teacher, info = None, {"candidates": 0, "teacher_error": str(e)}
            return teacher, groups | info

        pool.fold = self.options.fold_frozen
        with self.stage("candidates"):
            pool.build_frozen()  # before the workers share them
        cids = list(pool.uploads)
        return dict(zip(cids, self.parallel(one, cids)))

    def search(self, rnd: int, cid: str, pool: Pool) -> CmsrResult:
        """CMSR for one client: all candidates, or `max_candidates` of them drawn uniformly; pFedClub+ keeps only
        complete stitched candidates within (1+η)|w| and the device profile."""
        own = pool.uploads[cid].spec
        rng = np.random.default_rng(derive_seed(self.config.seed, "cmsr", rnd, cid))
        prune = accept = None
        if self.size_bound:
            prune, accept = self.size_checks(pool, own, self.profiles[cid])
        if self.options.exclude_self:
            accept = _both(accept, lambda keys: keys != own_keys(cid, own))
        return cmsr_search(
            cid,
            len(own.blocks),
            pool.kind_groups,
            rng,
            self.cmsr,
            similarity=pool.sim,
            max_candidates=self.options.max_candidates or None,
            prune=prune,
            accept=accept,
        )

    def size_checks(self, pool: Pool, own: ModelSpec, profile: DeviceProfile) -> tuple[Prune, Accept]:
        """pFedClub+ (§4.4) on whole models: prune a prefix whose blocks and stitches alone already exceed
        (1+η)|w| (completion only adds), accept a complete candidate whose stitched spec is within the bound
        and fits the profile (params, MACs, memory)."""
        eta = self.options.eta

        def prune(prefix: Candidate) -> bool:
            chain, _ = stitched_blocks([pool.blocks[k] for k in prefix], own.input_shape, None)
            return not within_size_bound(sum(b.params for b in chain), own.params, eta)

        def accept(keys: Candidate) -> bool:
            return not size_problems([pool.blocks[k] for k in keys], own, eta, profile)

        return prune, accept

    def teacher_for(self, rnd: int, cid: str, pool: Pool) -> tuple[Weights | None, dict[str, Any]]:
        """CMSR candidates → stitched → fine-tuned → matched (Alg. 1, Eq. 2-4), in chunks of
        CANDIDATE_CHUNK so memory stays bounded however many candidates there are; or the fallback.

        Candidates are modules over the pool's frozen block modules (built once per block, BatchNorm folded,
        channels-last: equal up to float rounding), with their own stitches; only the chosen one becomes weights,
        from the pool blocks' own tensors. The client's logits are those of the pool's feature pass."""
        own = pool.uploads[cid]
        with self.stage("candidates"):
            found = self.search(rnd, cid, pool)
        own_share, foreign = composition(cid, found.candidates)
        info: dict[str, Any] = {
            "candidates_total": found.total,
            "candidates": len(found.candidates),
            "candidates_rejected": found.rejected,
            "own_block_share": own_share,
            "foreign_blocks": foreign,
            "anchor": f"{pool.blocks[found.anchor].spec.origin.model}@{found.anchor[0]}:{found.anchor[1]}",
        }
        if not found.candidates:
            teacher, fallback = self.fallback(rnd, cid, own)
            return teacher, info | fallback
        x, y = self.public.x.to(pool.device), self.public.y
        y = None if y is None else y.to(pool.device)
        cfg = replace(self.finetune_config("finetune", rnd, cid), lockstep=self.options.lockstep)
        with self.stage("matching"):
            own_logits = pool.logits.get(cid)
            if own_logits is None:  # the feature pass kept no logits (minibatch CKA over a large public set)
                own_logits = public_logits([own], self.public.x, pool.device)[0]
        rng = np.random.default_rng(derive_seed(self.config.seed, "stitch-init", rnd, cid))
        best: tuple[float, FastBlocks, Candidate] | None = None
        steps, losses = set(), []
        for start in range(0, len(found.candidates), C.CANDIDATE_CHUNK):
            chunk = found.candidates[start : start + C.CANDIDATE_CHUNK]
            with self.stage("candidates"):
                built = [
                    assemble_modules(
                        f"teacher-{cid}-r{rnd}-{start + i}",
                        [pool.blocks[k] for k in ks],
                        *own_io(own),
                        rng,
                        pool.frozen,
                        pool.device,
                        pool.fold,
                    )
                    for i, ks in enumerate(chunk)
                ]
            modules, stitches = [m for m, _ in built], [t for _, t in built]
            with self.stage("finetune"):
                runs = train_stitch_modules(modules, stitches, x, y, cfg)
            steps |= {n for n, _ in runs}
            losses += [loss for _, loss in runs]
            with self.stage("matching"):
                starts = [t[0] if t else len(m.blocks) for m, t in built]
                _, scores = best_match(own_logits, module_logits(modules, starts, x, cfg.lockstep))
            for keys, module, score in zip(chunk, modules, scores):
                if math.isfinite(score) and (best is None or score > best[0]):  # ties: the earlier candidate
                    best = (score, module, keys)
        assert best is not None  # best_match raises when no score of a chunk is finite
        score, module, keys = best
        with self.stage("candidates"):
            teacher = assembled_weights(module, [pool.blocks[k] for k in keys])
        is_self = keys == own_keys(cid, own.spec)
        return teacher, info | {
            "match_score": score,
            "teacher_fallback": False,
            "teacher_is_self": is_self,
            "finetune_steps": max(steps),  # a candidate without a stitch (the client's own model) takes 0
            "finetune_batch": cfg.schedule(len(x))[0],
            "finetune_loss": losses,
        }

    def fallback(self, rnd: int, cid: str, own: Weights) -> tuple[Weights | None, dict[str, Any]]:
        """No candidate (for pFedClub+: none within its bound and the profile; with exclude_self: none but the client's
        own model): the client's own model is the teacher if it qualifies itself (pFedClub+: η ≥ 0), fits the profile
        and exclude_self is off, else the client trains without a teacher. Never an oversize teacher."""
        eta = self.options.eta if self.size_bound else 0.0  # pFedClub has no bound: its own model always meets it
        ok = (
            not self.options.exclude_self
            and within_size_bound(own.spec.params, own.spec.params, eta)
            and fits(own.spec, self.profiles[cid]).ok
        )
        log.warning(
            "round %d client %s: no candidate within |w*| <= (1+%g)|w| and profile %s%s; %s",
            rnd,
            cid,
            eta,
            self.profiles[cid].name,
            " other than its own model (exclude_self)" if self.options.exclude_self else "",
            "its own model is the teacher" if ok else "no teacher",
        )
        return (own if ok else None), {"teacher_fallback": True, "teacher_is_self": ok}


def own_keys(cid: str, spec: ModelSpec) -> Candidate:
    """The pool keys of the client's own model, in order: the candidate that is that model itself."""
    return tuple((cid, i) for i in range(len(spec.blocks)))


def own_io(own: Weights) -> tuple[tuple[int, ...], int]:
    """The client model's input shape and number of classes: every candidate of its takes and gives the same."""
    return own.spec.input_shape, own.spec.num_classes


def _both(first: Accept | None, second: Accept) -> Accept:
    return second if first is None else (lambda keys: first(keys) and second(keys))


@register_strategy("pfedclub+", PFedClubPlusOptions)
class PFedClubPlus(PFedClub):
    """pFedClub+ (§4.4): candidates must satisfy |w*| ≤ (1+η)|w| and fit the client's device profile."""

    size_bound = True
