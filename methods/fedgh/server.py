"""`fedgh` (Yi et al., ACM MM 2023): DC-PFL's shared head (methods/dcpfl) without its calibration: clients train on CE
alone (λ = 0) and upload class means (prototypes) and counts, no covariances; the server takes one SGD step of the
header per (client, class) prototype, in client order (the step the authors' code meant: theirs calls the last
client's optimizer, so the header never trains, original-code-notes §5.2). Its client half is DC-PFL's `dc_train`
(methods/dcpfl/client.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from methods.dcpfl.class_stats import ClassStats
from methods.dcpfl.maths import ce_step
from methods.dcpfl.server import SERVER_LR, SharedHead, check_server_lr
from server.strategy import StrategyOptions, option, register_strategy


@dataclass(frozen=True)
class FedGHOptions(StrategyOptions):
    """FedGH's one server setting: the learning rate of the header's steps."""

    server_lr: float = option(SERVER_LR, "the server's SGD learning rate for the header (the authors' code: 0.01)")

    def __post_init__(self) -> None:
        check_server_lr(self.server_lr)


@register_strategy("fedgh", FedGHOptions)
class FedGH(SharedHead):
    """FedGH: clients train on CE and upload class prototypes; the server takes one SGD step of the header per
    (client, class) prototype, in client order."""

    covariance = False

    def train_head(self, rnd: int, head: torch.nn.Module, replies: Sequence[tuple[str, ClassStats]]) -> None:
        for _, s in replies:
            for c in torch.nonzero(s.counts > 0).flatten().tolist():
                ce_step(head, s.means[c : c + 1], torch.tensor([c]), self.options.server_lr)
