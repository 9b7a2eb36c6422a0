"""`pfedme` (Dinh, Tran, Nguyen, NeurIPS 2020, Algorithm 1; a homogeneous baseline of pFedClub and pFedHR Table 2 and
FedMN Table II): the server sends w^t; each selected client personalizes θ under a Moreau envelope around its local
copy w and returns w (`pfedme_train`, methods/pfedme/client.py); the server takes w^{t+1} = (1 − β)w^t + β·mean(w_i)
(line 10), the mean example-weighted and capped as FedAvg's. Each client is evaluated on its own θ (a client that
never trained has none: the mean covers the clients that trained).

Where fedge chooses (docs/deviations.md): λ = 15, K = 5, personal step 0.01, η = 0.01 and β = 1 (the pFedMe paper's
MNIST settings as its authors' code runs them; none of the seed papers reports them); the mean is weighted by
examples, where line 10 averages the sampled clients uniformly; torch clients only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from fedge.config import ConfigError
from fedge.wire.messages import ClientInfo, Result, Task, Weights
from fedge.wire.payloads import Expected
from methods.fedavg.server import FedAvg, FedAvgOptions
from methods.pfedme.tasks import MoreauTask
from server.strategy import option, register_strategy, torch_profiles


@dataclass(frozen=True)
class PFedMeOptions(FedAvgOptions):
    """FedAvg's option and Algorithm 1's λ, K, personal step, η and β."""

    lamda: float = option(15.0, "λ of Eq. (7): how strongly θ is held near the local model w")
    inner_steps: int = option(5, "K: SGD steps solving Eq. (7) per batch")
    personal_lr: float = option(0.01, "the step size of θ's K steps")
    eta: float = option(0.01, "η of Eq. (8): the local model's step toward θ")
    beta: float = option(1.0, "β of line 10: the server's step toward the clients' mean, in (0, 1]; 1 = FedAvg's mean")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.beta <= 1:
            raise ConfigError(f"beta must be in (0, 1] (1: the clients' mean), got {self.beta}")
        try:
            MoreauTask(
                1,
                1,
                1.0,
                0,
                True,
                lamda=self.lamda,
                inner_steps=self.inner_steps,
                personal_lr=self.personal_lr,
                eta=self.eta,
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None


@register_strategy("pfedme", PFedMeOptions)
class PFedMe(FedAvg):
    """pFedMe: clients keep personalized θ, the server averages their local models w."""

    personalized = True

    def setup(self, clients: Mapping[str, ClientInfo]) -> None:
        torch_profiles(self.name, clients, "solves Moreau envelopes by plain SGD on every client")
        super().setup(clients)

    def plan(self, rnd: int, active: Sequence[str]) -> dict[str, Task]:
        self.shares = {}
        o = self.options
        settings = self.train_task(
            True,
            MoreauTask,
            lamda=o.lamda,
            inner_steps=o.inner_steps,
            personal_lr=o.personal_lr,
            eta=o.eta,
        )
        return {cid: Task("pfedme_train", rnd, settings.to_config(), {"global": self.global_model}) for cid in active}

    def expects(self, task: Task, client: ClientInfo) -> Expected:
        """A training reply carries the client's local model w, of the global architecture; an evaluation only
        metrics."""
        return Expected(models={"local": self.global_model.spec}) if task.type == "pfedme_train" else Expected()

    def aggregate(self, rnd: int, results: Mapping[str, Result]) -> None:
        """Line 10: FedAvg's mean of the replies' w, then w^{t+1} = (1 − β)w^t + β·mean (floating tensors)."""
        before = self.global_model
        super().aggregate(rnd, results)
        beta = self.options.beta
        if beta < 1 and self.global_model is not before:
            mean = self.global_model.state
            state = {
                k: (1 - beta) * v + beta * mean[k] if v.is_floating_point() else mean[k]
                for k, v in before.state.items()
            }
            self.global_model = Weights(before.spec, state)

    def evaluation(self, rnd: int, clients: Sequence[str]) -> dict[str, Task]:
        return {cid: Task("evaluate", rnd) for cid in clients}  # each client's own model: its θ
