"""pFedClub and pFedClub+ (NeurIPS 2024): CMSR candidates per client, stitched, fine-tuned, matched."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from device_profiles import fits, within_size_bound
from fedge import constants as C
from fedge.config import ConfigError
from fedge.messages import Weights
from fedge.seeding import derive_seed
from server.assemble import assemble, filter_by_size
from server.cmsr import CmsrOptions, cmsr_candidates
from server.reassembly import Key, Pool, ReassemblyOptions, ReassemblyStrategy
from server.strategy import StrategyError, option, register_strategy

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

    def __post_init__(self) -> None:
        super().__post_init__()
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
        """Each uploader's teacher; a client whose candidates fail (e.g. diverge) gets none, the others go on."""
        out = {}
        for cid in pool.uploads:
            try:
                out[cid] = self.teacher_for(rnd, cid, pool)
            except (ValueError, RuntimeError) as e:
                log.error("round %d client %s: no teacher this round, building it failed: %s", rnd, cid, e)
                out[cid] = (None, {"candidates": 0, "teacher_error": str(e)})
        return out

    def candidate_keys(self, rnd: int, cid: str, pool: Pool) -> list[tuple[tuple[str, int], ...]]:
        """CMSR block sequences for one client; pFedClub+ keeps only those within η and the profile."""
        own = pool.uploads[cid].spec
        cap = self.options.max_candidates * (C.PLUS_OVERSAMPLE if self.size_bound else 1)
        rng = np.random.default_rng(derive_seed(self.config.seed, "cmsr", rnd, cid))
        keys = cmsr_candidates(
            cid,
            len(own.blocks),
            pool.kind_groups,
            rng,
            self.cmsr,
            similarity=pool.sim,
            max_candidates=cap,
            allow=self.block_budget(pool) if self.size_bound else None,
        )
        if not self.size_bound:
            return keys
        blocks = [[pool.blocks[k] for k in ks] for ks in keys]
        kept, rejected = filter_by_size(blocks, own, self.options.eta, self.profiles[cid])
        for _, reason in rejected[:3]:
            log.debug("round %d client %s: candidate rejected: %s", rnd, cid, reason)
        kept_keys = [tuple(b.key for b in bs) for bs in kept]
        if len(kept_keys) > self.options.max_candidates:
            pick = rng.choice(len(kept_keys), self.options.max_candidates, replace=False)
            kept_keys = [kept_keys[i] for i in sorted(pick)]
        return kept_keys

    def block_budget(self, pool: Pool) -> Callable[[Key, Key], bool]:
        """pFedClub+ inside Step 2: a substitute may have at most (1+η)× the parameters of the block it replaces,
        so most paths can meet the whole-model bound; the exact bound is still checked after stitching."""

        def allow(own: Key, sub: Key) -> bool:
            return within_size_bound(pool.blocks[sub].spec.params, pool.blocks[own].spec.params, self.options.eta)

        return allow

    def teacher_for(self, rnd: int, cid: str, pool: Pool) -> tuple[Weights | None, dict[str, Any]]:
        """CMSR candidates → stitched → fine-tuned → matched (Alg. 1, Eq. 2-4); or the fallback."""
        own = pool.uploads[cid]
        with self.stage("candidates"):
            keys = self.candidate_keys(rnd, cid, pool)
            rng = np.random.default_rng(derive_seed(self.config.seed, "stitch-init", rnd, cid))
            candidates = [
                assemble(
                    f"teacher-{cid}-r{rnd}-{i}",
                    [pool.blocks[k] for k in ks],
                    own.spec.input_shape,
                    own.spec.num_classes,
                    rng,
                )
                for i, ks in enumerate(keys)
            ]
        if not candidates:
            return self.fallback(rnd, cid, own)
        tuned = self.finetune(rnd, cid, candidates)
        teacher, scores = self.match(own, tuned)
        return teacher, {
            "candidates": len(candidates),
            "match_score": max(s for s in scores if s == s),
            "teacher_fallback": False,
        }

    def fallback(self, rnd: int, cid: str, own: Weights) -> tuple[Weights | None, dict[str, Any]]:
        """No candidate (for pFedClub+: none within its bound and the profile): the client's own model is the
        teacher if it qualifies itself (pFedClub+: η ≥ 0) and fits the profile, else the client trains without a
        teacher. Never an oversize teacher."""
        eta = self.options.eta if self.size_bound else 0.0  # pFedClub has no bound: its own model always meets it
        ok = within_size_bound(own.spec.params, own.spec.params, eta) and fits(own.spec, self.profiles[cid]).ok
        log.warning(
            "round %d client %s: no candidate within |w*| <= (1+%g)|w| and profile %s; %s",
            rnd,
            cid,
            eta,
            self.profiles[cid].name,
            "its own model is the teacher" if ok else "no teacher",
        )
        return (own if ok else None), {"candidates": 0, "teacher_fallback": True}


@register_strategy("pfedclub+", PFedClubPlusOptions)
class PFedClubPlus(PFedClub):
    """pFedClub+ (§4.4): candidates must satisfy |w*| ≤ (1+η)|w| and fit the client's device profile."""

    size_bound = True
