"""FedAvg+'s task configuration, which both its halves share."""

from __future__ import annotations

from dataclasses import dataclass

from fedge.tasks import TrainTask


@dataclass(frozen=True)
class TuneEvaluateTask(TrainTask):
    """A `tune_evaluate` task: fine-tune a copy of the sent global model on the client's training data as TrainTask
    says (its `epochs` are the tuning epochs), then evaluate the copy on the client's test data. Nothing is uploaded
    (`upload` must be false) and the client's own model is left as it is."""
