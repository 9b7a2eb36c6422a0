"""pFedHR (NeurIPS 2023): one shared pool of candidates from its Alg. 1, matched to each client (Eq. (5))."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedge.config import ConfigError
from fedge.seeding import derive_seed
from fedge.wire.messages import Weights
from methods.pfedhr.candidates import SCANS, block_operations, depth_order, pfedhr_candidates
from methods.reassembly.assemble import assemble
from methods.reassembly.finetune import best_match, finetune_model, public_logits, train_model
from methods.reassembly.strategy import Pool, ReassemblyOptions, ReassemblyStrategy
from server.strategy import option, register_strategy

log = logging.getLogger(__name__)
FINETUNED = ("all", "stitches")


@dataclass(frozen=True)
class PFedHROptions(ReassemblyOptions):
    """pFedHR's options: the shared ones, plus how Alg. 1's scan reads lines 9-14."""

    scan: str = option(
        "first",
        "Alg. 1 lines 9-14: each group gives its first pair passing R1-R2 (first) or every such pair (every)",
    )

    pfedhr_finetune: str = option(
        "all",
        "what fine-tuning trains in each candidate: all its parameters (pFedHR §3.1.3 and the authors' code) or its "
        "stitches only (as pFedClub's Eq. (2))",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.scan not in SCANS:
            raise ConfigError(f"scan must be one of {', '.join(SCANS)}, got {self.scan!r}")
        if self.pfedhr_finetune not in FINETUNED:
            raise ConfigError(f"pfedhr_finetune must be one of {', '.join(FINETUNED)}, got {self.pfedhr_finetune!r}")


@register_strategy("pfedhr", PFedHROptions)
class PFedHR(ReassemblyStrategy):
    """Alg. 1 over all uploaded blocks (groups in depth order, `depth_order`) → stitched candidates shared by all
    clients → each client takes the candidate whose logits are most cosine-similar (Eq. (5)) to those of a copy of
    its model fine-tuned, all parameters, on the public data (§3.1.3). Candidates are fine-tuned on the public data
    too, every parameter of the stitched model (§3.1.3; `pfedhr_finetune=stitches`: the stitches only, as pFedClub).
    The copy serves only the matching: the uploaded model, and what the client gets, are untouched. M is what
    Alg. 1 finds (possibly 0: no teachers); sizes are not controlled.
    """

    def make_teachers(self, rnd: int, pool: Pool) -> dict[str, tuple[Weights | None, dict[str, Any]]]:
        """The shared candidates, then each uploader's best match; a client whose match fails gets no teacher."""
        any_spec = next(iter(pool.uploads.values())).spec
        with self.stage("candidates"):
            search = pfedhr_candidates(
                depth_order(pool.groups), block_operations(pool.blocks.values()), self.options.scan
            )
            rng = np.random.default_rng(derive_seed(self.config.seed, "pfedhr", rnd))  # stitch weights only
            candidates = [
                assemble(
                    f"pfedhr-r{rnd}-{i}", [pool.blocks[k] for k in ks], any_spec.input_shape, any_spec.num_classes, rng
                )
                for i, ks in enumerate(search.candidates)
            ]
        log.info(
            "round %d: pFedHR Alg. 1 built %d candidates (one per block), %d failed R3, %d failed R4, kept M = %d",
            rnd,
            search.generated,
            search.failed_r3,
            search.failed_r4,
            len(candidates),
        )
        info = {"candidates": len(candidates), "candidates_generated": search.generated}
        if not candidates:
            log.warning("round %d: pFedHR found no candidate passing R1-R4; clients keep training without one", rnd)
            return {cid: (None, dict(info)) for cid in pool.uploads}
        if self.options.pfedhr_finetune == "all":
            cfg = self.finetune_config("finetune", rnd, "shared")
            with self.stage("finetune"):
                runs = [train_model(w, self.public.x, self.public.y, cfg, self.config.device) for w, _ in candidates]
        else:
            runs = self.finetune(rnd, "shared", candidates)
        tuned = [r.weights for r in runs]
        info |= {"finetune_steps": runs[0].steps, "finetune_loss": [r.loss for r in runs]}
        with self.stage("matching"):
            tuned_logits = public_logits(tuned, self.public.x, self.config.device)
        out: dict[str, tuple[Weights | None, dict[str, Any]]] = {}
        for cid, own in pool.uploads.items():
            try:
                logits = self.finetuned_logits(rnd, cid, own)
                with self.stage("matching"):
                    best, scores = best_match(logits, tuned_logits)
            except (ValueError, RuntimeError) as e:  # e.g. its copy diverged: the other clients go on
                log.error("round %d client %s: no teacher this round, matching failed: %s", rnd, cid, e)
                out[cid] = (None, info | {"teacher_error": str(e)})
                continue
            out[cid] = (tuned[best], info | {"match_score": scores[best]})
        return out

    def finetuned_logits(self, rnd: int, cid: str, own: Weights) -> torch.Tensor:
        """Logits on the public data of a copy of `own` fine-tuned, all parameters (§3.1.3: CE if the public data are
        labeled, NT-Xent on two views if not), as the candidates are; `own` stays as uploaded."""
        cfg = self.finetune_config("finetune-client", rnd, cid)
        with self.stage("finetune"):
            copy = finetune_model(own, self.public.x, self.public.y, cfg, self.config.device)
        with self.stage("matching"):
            return public_logits([copy], self.public.x, self.config.device)[0]
