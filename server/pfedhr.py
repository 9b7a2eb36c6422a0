"""pFedHR (NeurIPS 2023): one shared pool of rule-checked candidates (its Alg. 1), matched to each client."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from fedge.messages import Weights
from fedge.seeding import derive_seed
from server.assemble import assemble
from server.finetune import best_match, public_logits
from server.pfedhr_candidates import PFedHROptions, block_operations, classifier_keys, pfedhr_candidates
from server.reassembly import Pool, ReassemblyOptions, ReassemblyStrategy
from server.strategy import register_strategy

log = logging.getLogger(__name__)


@register_strategy("pfedhr", ReassemblyOptions)
class PFedHR(ReassemblyStrategy):
    """Candidates R1–R4 over all uploaded blocks, stitched and fine-tuned once; each client takes the one whose
    logits match its own best (Eq. (4) of pFedClub, pFedHR's §3.2 selection). Sizes are not controlled."""

    def make_teachers(self, rnd: int, pool: Pool) -> dict[str, tuple[Weights | None, dict[str, Any]]]:
        any_spec = next(iter(pool.uploads.values())).spec
        with self.stage("candidates"):
            rng = np.random.default_rng(derive_seed(self.config.seed, "pfedhr", rnd))
            blocks = list(pool.blocks.values())
            keys = pfedhr_candidates(
                pool.groups,
                block_operations(blocks),
                rng,
                PFedHROptions(),
                classifier_keys(blocks),
            )
            candidates = [
                assemble(
                    f"pfedhr-r{rnd}-{i}", [pool.blocks[k] for k in ks], any_spec.input_shape, any_spec.num_classes, rng
                )
                for i, ks in enumerate(keys)
            ]
        if not candidates:
            log.warning("round %d: pFedHR found no candidate passing R1-R4; clients keep training without one", rnd)
            return {cid: (None, {"candidates": 0}) for cid in pool.uploads}
        tuned = self.finetune(rnd, "shared", candidates)
        with self.stage("matching"):  # every candidate's logits once, then each client's own (Eq. (4))
            tuned_logits = public_logits(tuned, self.public.x, self.config.device)
            own_logits = public_logits(list(pool.uploads.values()), self.public.x, self.config.device)
        out = {}
        for cid, logits in zip(pool.uploads, own_logits):
            best, scores = best_match(logits, tuned_logits)
            out[cid] = (tuned[best], {"candidates": len(candidates), "match_score": scores[best]})
        return out
