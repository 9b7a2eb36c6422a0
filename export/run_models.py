"""A run folder's final models: written at the end of a run (<run>/models/<client>/<role>.safetensors + .onnx),
and read back for `fedge export` (teachers from there, students from the clients' newest snapshots)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Mapping

import torch
from tqdm import tqdm

from export import ExportError
from export.onnx import OnnxReport, export_onnx
from fedge import constants as C
from fedge.checkpoint import CheckpointError, load_tree
from fedge.data.datasets import Dataset
from fedge.data.partition import stratified_sample
from fedge.model.weights import WeightsError, load_model, save_model
from fedge.wire.messages import Weights

log = logging.getLogger(__name__)

SERVER_ROLES = ("teacher", "model")  # final models the server writes to <run>/models/<client>/<role>.safetensors
ROLES = SERVER_ROLES + ("student",)
PARITY_SAMPLES = 64  # real dataset images each export is checked on
JSON_PROPS = ("class_names", "mean", "std", "client_classes", "personalized")  # metadata props holding JSON


def parity_sample(ds: Dataset, n: int = PARITY_SAMPLES) -> torch.Tensor:
    """`n` images of the dataset drawn by the default seed with its class proportions kept, normalised as in
    training (real inputs for the parity check; never the first n, which may all be of one class)."""
    return ds.tensors(stratified_sample(ds.y, n, C.DEFAULT_SEED))[0]


def model_metadata(
    run: Mapping[str, str], client: str, role: str, rnd: int | None, classes: Mapping[str, int] | None
) -> dict[str, str]:
    """The metadata props of one model exported from a run: the run's (launch.runs.run_metadata: run folder,
    run id, strategy, personalized, dataset, class names, normalisation), then client, role, round and
    `client_classes`, the client's training classes with their counts (JSON; absent when `classes` is None or
    empty: a shared model, or a client that read its own data)."""
    meta = dict(run) | {"client": client, "role": role, "round": "" if rnd is None else str(rnd)}
    return meta | ({"client_classes": json.dumps(dict(classes))} if classes else {})


def write_final_models(
    run_dir: str | Path,
    finals: Mapping[str, Mapping[str, Weights]],
    ds: Dataset,
    rnd: int | None,
    run: Mapping[str, str],
    classes: Mapping[str, Mapping[str, int]],
    onnx: bool = True,
    progress: bool = False,
) -> dict[str, dict[str, OnnxReport | None]]:
    """Save each client's final models as <run>/models/<client>/<role>.safetensors and, with `onnx`, export
    and check <role>.onnx (parity on `ds`'s images; metadata `run` and the client's `classes`, see
    model_metadata). An export that fails its check is logged as an error and left out (None): the run's other
    results stay valid."""
    reports: dict[str, dict[str, OnnxReport | None]] = {}
    sample = parity_sample(ds) if onnx and finals else None
    for client, models in tqdm(
        finals.items(),
        desc="export ONNX" if onnx else "save models",
        unit="client",
        disable=not progress,
        dynamic_ncols=True,
    ):
        for role, weights in models.items():
            folder = Path(run_dir) / C.FINAL_MODELS_DIR / client
            save_model(folder / f"{role}.safetensors", weights.spec, weights.state)
            if sample is None:
                continue
            try:
                meta = model_metadata(run, client, role, rnd, classes.get(client))
                report = export_onnx(weights.spec, weights.state, folder / f"{role}.onnx", sample, meta)
                log.info("client %s %s → %s (max abs diff %.2g)", client, role, report.path, report.max_abs_diff)
            except ExportError as e:
                log.error("client %s: the final %s was not exported to ONNX: %s", client, role, e)
                report = None
            reports.setdefault(client, {})[role] = report
    return reports


def run_config(run_dir: str | Path) -> dict[str, Any]:
    """The config.json of a run folder; a missing folder or file raises ExportError."""
    run = Path(run_dir)
    if not run.is_dir():
        raise ExportError(f"run folder {run} does not exist; pass the folder a `fedge run` wrote (its --out)")
    try:
        return json.loads((run / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ExportError(f"{run} is not a fedge run folder (no readable config.json: {e})") from None


def load_final_model(run_dir: str | Path, client: str, what: str) -> tuple[Weights, int | None]:
    """A client's final server-side model (<run>/models/<client>/<role>.safetensors: pFedClub's/pFedHR's `teacher`,
    FedTrans's/HeteroFL's `model`) or student (its newest snapshot in <run>/clients/<client>/), with the round it is
    from (None for server-side models). A missing run, an unknown client,
    an unknown role, or no model on disk raise ExportError saying which."""
    cfg = run_config(run_dir)
    if what not in ROLES:
        raise ExportError(f"unknown model {what!r}; choose one of {', '.join(ROLES)}")
    clients = [str(i) for i in range(int(cfg.get("clients", 0)))]
    if client not in clients:
        raise ExportError(f"run {run_dir} has no client {client!r}; its clients are 0..{len(clients) - 1}")
    run = Path(run_dir)
    if what in SERVER_ROLES:
        path = run / C.FINAL_MODELS_DIR / client / f"{what}.safetensors"
        if not path.exists():
            raise ExportError(
                f"client {client} has no final {what} in {path.parent} (the strategy "
                f"{cfg.get('strategy')!r} builds none, or the client never got one)"
            )
        try:
            spec, state = load_model(path)
        except WeightsError as e:
            raise ExportError(str(e)) from None
        return Weights(spec, state), None
    snapshots = sorted((run / C.CLIENT_STATE_DIR / client).glob("round-*.safetensors"), reverse=True)
    for path in snapshots:
        try:
            tree = load_tree(path)
            return tree["model"], int(tree["round"])
        except (CheckpointError, KeyError, TypeError, ValueError) as e:
            log.warning("client %s: snapshot %s is unusable, trying an older one: %s", client, path, e)
    raise ExportError(f"client {client} has no readable model snapshot in {run / C.CLIENT_STATE_DIR / client}")
