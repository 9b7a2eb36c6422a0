"""What an accepted upload may be, relative to its reference and to the round: parameter norms, sane BatchNorm
statistics, and updates (upload minus what the server sent) clipped to a multiple of the round's median, with
outliers refused (issue 28). Pure functions plus the history the clipping needs; the coordinator applies them."""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from collections import Counter
from typing import Iterable, Mapping, Sequence

import torch

from fedge import constants as C
from fedge.model.spec import ModelSpec, build, parameter_names
from fedge.model.weights import State
from fedge.wire.messages import Result, Task, Weights, client_order

RUNNING_MEAN, RUNNING_VAR = "running_mean", "running_var"  # BatchNorm's running statistics (torch's buffer names)
TENSORS = "tensors"  # the update group of a reply's named tensors (a model role's group is the role)


def tensors_norm(tensors: Iterable[torch.Tensor]) -> float:
    """The L2 norm over every floating-point tensor of `tensors` together (others are skipped), the same whatever
    their order (math.fsum is exactly rounded): a model decoded from bytes may list its tensors in another order."""
    return math.sqrt(math.fsum(float(t.double().square().sum()) for t in tensors if t.is_floating_point()))


def upload_norm(weights: Weights) -> float:
    """The L2 norm over the learned parameters of one uploaded model (buffers such as BatchNorm's running
    statistics are not what training optimises: buffer_norm and buffer_rejection check them)."""
    names = parameter_names(weights.spec)
    return tensors_norm(t for n, t in weights.state.items() if n in names)


def buffer_norm(weights: Weights) -> float:
    """The L2 norm over the floating buffers of one uploaded model (BatchNorm's running statistics)."""
    names = parameter_names(weights.spec)
    return tensors_norm(t for n, t in weights.state.items() if n not in names)


@functools.lru_cache(maxsize=64)
def fresh_norms(spec_json: str) -> tuple[float, float]:
    """The (parameter, buffer) norms of a freshly initialised model of this architecture (fixed seed; the global RNG
    is left as is)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        spec = ModelSpec.from_json(spec_json)
        fresh = Weights(spec, build(spec).state_dict())
        return upload_norm(fresh), buffer_norm(fresh)


def reference_norm(weights: Weights, task: Task, previous: float | None, buffers: bool = False) -> tuple[float, str]:
    """What an upload's parameter norm (with `buffers`, its buffer norm) is bounded by, and its name: that of the
    model of the same architecture the server sent in the task (FedAvg's global model), else of the client's previous
    accepted upload of that role (`previous`), else of a fresh initialisation of the architecture. Each is the
    server's own state or was checked before."""
    arch = weights.spec.with_origin(None)
    sent = [m for m in task.models.values() if m.spec.with_origin(None) == arch]
    if sent:
        return (buffer_norm if buffers else upload_norm)(sent[0]), "the model it was sent"
    if previous is not None:
        return previous, "its previous accepted upload"
    return fresh_norms(arch.to_json())[buffers], "a fresh initialisation of its architecture"


def norm_outliers(results: Mapping[str, Result]) -> dict[str, str]:
    """Client → message for each reply with an uploaded model whose parameter norm exceeds NORM_OUTLIER_FACTOR
    times the median norm of that model role this round; a role is checked only with at least NORM_MIN_UPLOADS
    uploads."""
    out: dict[str, str] = {}
    for role in sorted({role for res in results.values() for role in res.models}):
        norms = {cid: upload_norm(res.models[role]) for cid, res in results.items() if role in res.models}
        if len(norms) < C.NORM_MIN_UPLOADS:
            continue
        median = statistics.median(norms.values())
        for cid, norm in norms.items():
            if norm > C.NORM_OUTLIER_FACTOR * median:
                out.setdefault(
                    cid,
                    f"model {role!r} has norm {norm:.4g}, over {C.NORM_OUTLIER_FACTOR:g} x "
                    f"the round's median {median:.4g}",
                )
    return out


def buffer_rejection(tensors: Mapping[str, torch.Tensor], where: str) -> str | None:
    """Why BatchNorm running statistics among `tensors` (by name suffix) are impossible, else None: a running
    variance below 0 or beyond MAX_FEATURE_MAGNITUDE², a running mean beyond MAX_FEATURE_MAGNITUDE (the data are
    normalised to unit scale; features of a trained network are O(1-100)). `where` names the
    model in the message."""
    bound = C.MAX_FEATURE_MAGNITUDE
    for name, t in tensors.items():
        kind = name.rpartition(".")[2]
        if kind == RUNNING_VAR and t.numel() and not (float(t.min()) >= 0 and float(t.max()) <= bound**2):
            return f"{where} {name} is outside [0, {bound**2:g}] (a BatchNorm running variance)"
        if kind == RUNNING_MEAN and t.numel() and float(t.abs().max()) > bound:
            return f"{where} {name} is beyond ±{bound:g} (a BatchNorm running mean)"
    return None


def reply_buffer_rejection(res: Result) -> str | None:
    """buffer_rejection of every uploaded model and of the reply's named tensors."""
    for role, weights in res.models.items():
        why = buffer_rejection(weights.state, f"model {role!r}:")
        if why:
            return why
    return buffer_rejection(res.tensors, "tensor")


def update_pairs(
    task: Task, res: Result, update_of: Mapping[str, str], tensor_updates: bool
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Key → (uploaded, sent) for every floating tensor of the reply that updates one the task sent: tensors of a
    model role that `update_of` maps to a task model role ("<role>/<name>"), and, with `tensor_updates`, named
    tensors the task also sent ("<name>"). Same shape only (the declaration checked that already)."""
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for role, sent_role in update_of.items():
        if role in res.models and sent_role in task.models:
            sent = task.models[sent_role].state
            for name, t in res.models[role].state.items():
                if t.is_floating_point() and name in sent and sent[name].shape == t.shape:
                    out[f"{role}/{name}"] = (t, sent[name])
    if tensor_updates:
        for name, t in res.tensors.items():
            if t.is_floating_point() and name in task.tensors and task.tensors[name].shape == t.shape:
                out[name] = (t, task.tensors[name])
    return out


def rms(t: torch.Tensor) -> float:
    """Root mean square of a tensor's entries (comparable across tensors of different sizes, HeteroFL's slices)."""
    return math.sqrt(float(t.double().square().mean())) if t.numel() else 0.0


class UpdateBounds:
    """Bounds every update relative to the round: clip_factor x the median of that tensor's updates in the round
    (at least NORM_MIN_UPLOADS of them that moved), else of its recent history; and refuses a reply whose whole
    parameter update is an outlier the same way. An update of exactly zero (a tensor the client did not train, such
    as FedMN's router when it learns no routing) is neither a reference nor history. The history holds the last
    CLIP_HISTORY values of rounds with enough updates; a round without enough adds at most its reference, so no
    client alone can grow it. Keeps the counts of clipped tensors per client; both are checkpointed by the
    coordinator."""

    def __init__(self, clip_factor: float) -> None:
        self.clip_factor = clip_factor
        self.history: dict[str, list[float]] = {}  # key -> recent update RMS values of rounds with enough of them
        self.clipped: Counter[str] = Counter()  # client -> tensors clipped over the run

    def scale(self, key: str, values: Sequence[float]) -> tuple[float | None, bool]:
        """(the reference of `key` this round, whether it is the round's own): the median of the values that moved
        when there are enough of them, else the median of the history, else None (nothing to compare with)."""
        moved = [v for v in values if v > 0]
        if len(moved) >= C.NORM_MIN_UPLOADS:
            return statistics.median(moved), True
        history = self.history.get(key)
        return (statistics.median(history) if history else None), False

    def remember(self, key: str, values: Sequence[float], ref: float | None, own: bool) -> None:
        """Add a round's accepted values of `key` to its history: as they are in a round with its own reference,
        each at most the reference in one without (none when there is no reference)."""
        if not own:
            values = [] if ref is None else [min(v, ref) for v in values]
        moved = [v for v in values if v > 0]
        if moved:
            self.history[key] = (self.history.get(key, []) + moved)[-C.CLIP_HISTORY :]

    def apply(
        self,
        pairs: Mapping[str, Mapping[str, tuple[torch.Tensor, torch.Tensor]]],
        params: Mapping[str, Mapping[str, frozenset[str]]],
    ) -> tuple[dict[str, str], dict[str, State]]:
        """(client → why it is refused, client → its clipped tensors by key) for the round's update pairs
        (update_pairs, per client; `params`: per client and group, its learned parameters' names). A client whose
        whole parameter update of a group has an RMS over UPDATE_OUTLIER_FACTOR x the group's reference is refused;
        every other client's tensors are clipped (clip). The accepted values join the history, in client order (a
        round over MQTT, where replies arrive in any order, gives the in-process run's history)."""
        order = sorted(pairs, key=client_order)
        groups = {cid: parameter_update_rms(pairs[cid], params[cid]) for cid in order}
        refused: dict[str, str] = {}
        refs = {}
        for group in sorted({g for per in groups.values() for g in per}):
            values = {cid: per[group] for cid, per in groups.items() if group in per}
            refs[group] = ref, own = self.scale(f"#{group}", list(values.values()))
            for cid, value in values.items():
                if ref is not None and value > C.UPDATE_OUTLIER_FACTOR * ref:
                    refused.setdefault(
                        cid,
                        f"its update of {group} has RMS {value:.4g}, over {C.UPDATE_OUTLIER_FACTOR:g} x the "
                        f"{'round' if own else 'recent'} median {ref:.4g}",
                    )
        kept = [cid for cid in order if cid not in refused]
        for group, (ref, own) in refs.items():
            self.remember(f"#{group}", [groups[cid][group] for cid in kept if group in groups[cid]], ref, own)
        return refused, self.clip({cid: pairs[cid] for cid in kept})

    def clip(self, pairs: Mapping[str, Mapping[str, tuple[torch.Tensor, torch.Tensor]]]) -> dict[str, State]:
        """Client → its clipped tensors by key (only those clipped): each update u = uploaded - sent whose RMS
        exceeds clip_factor x the key's reference is scaled to it, sent + u·bound/RMS(u) in the upload's dtype.
        Records the accepted (clipped) values in the history."""
        out: dict[str, State] = {}
        order = sorted(pairs, key=client_order)
        values = {cid: {k: rms(up.double() - sent.double()) for k, (up, sent) in pairs[cid].items()} for cid in order}
        for key in sorted({k for per in pairs.values() for k in per}):
            holders = {cid: per[key] for cid, per in values.items() if key in per}
            ref, own = self.scale(key, list(holders.values()))
            for cid, value in holders.items():
                if self.clip_factor and ref is not None and value > self.clip_factor * ref:
                    up, sent = pairs[cid][key]
                    bound = self.clip_factor * ref
                    update = (up.double() - sent.double()) * (bound / value)
                    out.setdefault(cid, {})[key] = (sent.double() + update).to(up.dtype)
                    holders[cid] = bound
                    self.clipped[cid] += 1
            self.remember(key, list(holders.values()), ref, own)
        return out

    def state(self) -> dict[str, object]:
        return {"history": {k: list(v) for k, v in self.history.items()}, "clipped": dict(self.clipped)}

    def load_state(self, state: Mapping[str, object] | None) -> None:
        """Take a checkpoint's history and counts; an older checkpoint without them starts empty."""
        state = state or {}
        self.history = {k: [float(x) for x in v] for k, v in dict(state.get("history", {})).items()}  # type: ignore[arg-type]
        self.clipped = Counter({k: int(v) for k, v in dict(state.get("clipped", {})).items()})  # type: ignore[arg-type]


def parameter_update_rms(
    pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]], params: Mapping[str, frozenset[str]]
) -> dict[str, float]:
    """Per group (a model role, or TENSORS for named tensors), the RMS of the whole update of its learned
    parameters (`params`: per group, their names), the same whatever the order of `pairs` (exactly rounded sums)."""
    squares: dict[str, list[float]] = {}
    counts: Counter[str] = Counter()
    for key, (up, sent) in pairs.items():
        role, _, name = key.rpartition("/")
        group = role or TENSORS
        if name not in params.get(group, ()):
            continue
        d = up.double() - sent.double()
        squares.setdefault(group, []).append(float(d.square().sum()))
        counts[group] += d.numel()
    return {group: math.sqrt(math.fsum(s) / counts[group]) for group, s in squares.items() if counts[group]}


def with_tensors(res: Result, clipped: Mapping[str, torch.Tensor]) -> Result:
    """`res` with the tensors of `clipped` (keys as update_pairs names them) replaced."""
    models = dict(res.models)
    tensors = dict(res.tensors)
    for key, t in clipped.items():
        role, _, name = key.rpartition("/")
        if role:
            models[role] = Weights(models[role].spec, {**models[role].state, name: t})
        else:
            tensors[name] = t
    return dataclasses.replace(res, models=models, tensors=tensors)
