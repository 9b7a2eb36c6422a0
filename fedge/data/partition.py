"""Splits a labelled dataset into a public set and per-client train/test shards, as in the papers."""

from __future__ import annotations

import logging
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from fedge.constants import (
    CLASSES_PER_CLIENT,
    DEFAULT_SEED,
    DIRICHLET_ALPHA,
    DIRICHLET_MAX_DRAWS,
    DIRICHLET_MIN_CLIENT_SAMPLES,
    LABEL_CLUSTERS,
    PUBLIC_FRACTION,
    TEST_FRACTION_OF_CLIENT,
)
from fedge.errors import UserError

logger = logging.getLogger(__name__)


class PartitionError(UserError, ValueError):
    """A partition that cannot be made; the message names the field and what is allowed."""


def _require_int(field: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise PartitionError(f"PartitionConfig.{field} must be an integer >= {minimum}, got {value!r}")


def _require_fraction(field: str, value: object, low_open: bool) -> None:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not ((0 < value < 1) if low_open else (0 <= value < 1)):  # type: ignore[operator]
        allowed = "0 < value < 1" if low_open else "0 <= value < 1"
        raise PartitionError(f"PartitionConfig.{field} must satisfy {allowed}, got {value!r}")


@dataclass(frozen=True)
class PartitionConfig:
    """How to split a dataset among clients (pFedClub §4.1: 72 % train / 20 % test / 8 % public).

    `scheme` is "iid", "noniid" (`classes_per_client` classes each), "dirichlet" (per-class
    proportions ~ Dir(`alpha`)) or "clustered" (FedEM's: classes in `label_clusters` groups, per-group proportions
    ~ Dir(`alpha`)). `test_fraction` is the share of each client's own data held out
    as its test set. `max_samples_per_client` caps train + test of every client, and
    `max_public_samples` the public set, both keeping class proportions. Invalid values raise PartitionError
    naming the field and the allowed range.
    """

    scheme: str
    num_clients: int
    classes_per_client: int = CLASSES_PER_CLIENT
    alpha: float = DIRICHLET_ALPHA
    label_clusters: int = LABEL_CLUSTERS
    public_fraction: float = PUBLIC_FRACTION
    test_fraction: float = TEST_FRACTION_OF_CLIENT
    seed: int = DEFAULT_SEED
    max_samples_per_client: int | None = None
    max_public_samples: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.scheme, str) or self.scheme not in _ASSIGNERS:
            raise PartitionError(f"PartitionConfig.scheme must be one of {sorted(_ASSIGNERS)}, got {self.scheme!r}")
        _require_int("num_clients", self.num_clients, 1)
        _require_int("classes_per_client", self.classes_per_client, 1)
        _require_int("label_clusters", self.label_clusters, 1)
        _require_int("seed", self.seed, 0)
        if self.max_samples_per_client is not None:
            _require_int("max_samples_per_client", self.max_samples_per_client, 1)
        if self.max_public_samples is not None:
            _require_int("max_public_samples", self.max_public_samples, 1)
        alpha = self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0 < alpha < math.inf:
            raise PartitionError(f"PartitionConfig.alpha must be a finite number > 0, got {alpha!r}")
        _require_fraction("public_fraction", self.public_fraction, low_open=False)
        _require_fraction("test_fraction", self.test_fraction, low_open=True)


@dataclass(frozen=True, eq=False)
class ClientShard:
    """One client's sample indices into `Dataset.x`: sorted, int64, read-only, disjoint from all others."""

    client_id: int
    train: np.ndarray
    test: np.ndarray


@dataclass(frozen=True, eq=False)
class Partition:
    """The public set (server side, never given to a client) and every client's shard, by client id."""

    public: np.ndarray
    clients: tuple[ClientShard, ...]


def _indices(parts: list[np.ndarray]) -> np.ndarray:
    """Sorted, read-only int64 concatenation of index arrays (empty if there are none)."""
    out = np.sort(np.concatenate(parts)).astype(np.int64) if parts else np.empty(0, dtype=np.int64)
    out.setflags(write=False)
    return out


def _round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


def _check_labels(y: np.ndarray, num_classes: int) -> np.ndarray:
    y = np.asarray(y)
    if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) or num_classes < 1:
        raise PartitionError(f"num_classes must be an integer >= 1, got {num_classes!r}")
    if y.ndim != 1 or y.dtype.kind not in "iu":
        raise PartitionError(f"labels y must be a 1-D integer array, got {y.dtype} {y.shape}")
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise PartitionError(f"labels y must lie in [0, {num_classes}), got {y.min()}..{y.max()}")
    return y


def _split_public(
    y: np.ndarray, num_classes: int, fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Stratified public set (a random `fraction` of every class) and each class's shuffled rest."""
    public, pools = [], []
    for c in range(num_classes):
        members = rng.permutation(np.flatnonzero(y == c))
        n_public = _round_half_up(len(members) * fraction)
        public.append(members[:n_public])
        pools.append(members[n_public:])
    return _indices(public), pools


Assigner = Callable[[list[np.ndarray], PartitionConfig, np.random.Generator], list[np.ndarray]]


def _assign_iid(pools: list[np.ndarray], config: PartitionConfig, rng: np.random.Generator) -> list[np.ndarray]:
    """Uniformly random, equal-sized split of all remaining samples."""
    return list(np.array_split(rng.permutation(np.concatenate(pools)), config.num_clients))


def _assign_noniid(pools: list[np.ndarray], config: PartitionConfig, rng: np.random.Generator) -> list[np.ndarray]:
    """Each client gets `classes_per_client` distinct classes, drawn among the least-used ones so far.

    Class usage counts stay within one of each other (10 clients x 2 classes: every class is held
    by exactly 2 clients); a class's samples are split evenly among its holders. Classes no client
    holds (when num_clients * k < classes) stay unused. Raises PartitionError when k exceeds the
    number of classes that have data.
    """
    available = np.array([c for c, pool in enumerate(pools) if len(pool)], dtype=np.int64)
    k = config.classes_per_client
    if k > len(available):
        raise PartitionError(
            f"PartitionConfig.classes_per_client={k} exceeds the {len(available)} classes "
            f"that have samples; allowed 1..{len(available)}"
        )
    usage = np.zeros(len(available), dtype=np.int64)
    holders: list[list[int]] = [[] for _ in pools]
    for client in range(config.num_clients):
        order = rng.permutation(len(available))
        chosen = order[np.argsort(usage[order], kind="stable")[:k]]
        usage[chosen] += 1
        for c in available[chosen]:
            holders[c].append(client)
    parts: list[list[np.ndarray]] = [[] for _ in range(config.num_clients)]
    for c, clients in enumerate(holders):
        for client, chunk in zip(clients, np.array_split(pools[c], max(len(clients), 1))):
            parts[client].append(chunk)
    return [np.concatenate(p) for p in parts]


def _assign_dirichlet(pools: list[np.ndarray], config: PartitionConfig, rng: np.random.Generator) -> list[np.ndarray]:
    """Per class, proportions over clients ~ Dir(alpha) (Hsu et al. 2019); see _dirichlet_split."""
    return _dirichlet_split(pools, config, rng, "dirichlet")


def _assign_clustered(pools: list[np.ndarray], config: PartitionConfig, rng: np.random.Generator) -> list[np.ndarray]:
    """FedEM's split (Marfoq et al. 2021, used by FedMN): the classes that have samples are shuffled into
    `label_clusters` groups of (nearly) equal size, and each group's samples, in random order, are split over the
    clients by proportions ~ Dir(alpha) drawn once per group; see _dirichlet_split. Raises PartitionError when
    there are fewer classes with samples than groups."""
    available = [c for c, pool in enumerate(pools) if len(pool)]
    if config.label_clusters > len(available):
        raise PartitionError(
            f"PartitionConfig.label_clusters={config.label_clusters} exceeds the {len(available)} classes that "
            f"have samples; allowed 1..{len(available)}"
        )
    groups = np.array_split(rng.permutation(available), config.label_clusters)
    return _dirichlet_split(
        [rng.permutation(np.concatenate([pools[c] for c in g])) for g in groups], config, rng, "clustered"
    )


def _dirichlet_split(
    groups: list[np.ndarray],
    config: PartitionConfig,
    rng: np.random.Generator,
    scheme: str,
    min_samples: int = DIRICHLET_MIN_CLIENT_SAMPLES,
    max_draws: int = DIRICHLET_MAX_DRAWS,
) -> list[np.ndarray]:
    """Each group's samples split over the clients in proportions ~ Dir(alpha), drawn per group.

    Redraws the whole split (up to `max_draws` times) while any client has fewer than
    `min_samples` samples (train + test), then raises PartitionError asking for a larger alpha
    or fewer clients.
    """
    n = config.num_clients
    total = sum(len(g) for g in groups)
    if total < n * min_samples:
        raise PartitionError(
            f"{scheme}: {total} samples cannot give each of PartitionConfig.num_clients"
            f"={n} clients {min_samples}; use fewer clients"
        )
    for _ in range(max_draws):
        parts: list[list[np.ndarray]] = [[] for _ in range(n)]
        for group in groups:
            cuts = (np.cumsum(rng.dirichlet(np.full(n, config.alpha)))[:-1] * len(group)).astype(np.int64)
            for client, chunk in enumerate(np.split(group, cuts)):
                parts[client].append(chunk)
        if min(sum(len(c) for c in p) for p in parts) >= min_samples:
            return [np.concatenate(p) for p in parts]
    raise PartitionError(
        f"{scheme}: after {max_draws} draws some client still had fewer than "
        f"{min_samples} samples; use a larger PartitionConfig.alpha (got {config.alpha}) "
        "or fewer num_clients"
    )


_ASSIGNERS: dict[str, Assigner] = {
    "iid": _assign_iid,
    "noniid": _assign_noniid,
    "dirichlet": _assign_dirichlet,
    "clustered": _assign_clustered,
}
SCHEMES: tuple[str, ...] = tuple(_ASSIGNERS)


def stratified_cap(pool: np.ndarray, y: np.ndarray, cap: int, every_class: bool = True) -> np.ndarray:
    """The first `cap` samples of `pool` (in random order) class by class, class proportions kept: each class
    present gets its share of `cap` rounded by largest remainder (within one sample of it). With `every_class`
    (a client's shard, whose class set must survive the cap) a class whose share rounds to none still gets one
    sample when `cap` allows it, taken from the largest. A pool of at most `cap` samples is returned as it is.
    """
    if len(pool) <= cap:
        return pool
    labels = y[pool]
    classes, counts = np.unique(labels, return_counts=True)
    exact = counts * cap / len(pool)
    quota = np.floor(exact).astype(np.int64)
    quota[np.argsort(-(exact - quota), kind="stable")[: cap - int(quota.sum())]] += 1
    if every_class and cap >= len(classes):
        for i in np.flatnonzero(quota == 0):
            quota[np.argmax(quota)] -= 1
            quota[i] = 1
    return np.concatenate([pool[labels == c][:q] for c, q in zip(classes, quota)])


def stratified_sample(y: np.ndarray, n: int, seed: int, among: np.ndarray | None = None) -> np.ndarray:
    """Sorted indices of at most `n` samples of `among` (default: all of `y`), drawn by `seed` with the class
    proportions of `among` kept, every class within one sample of its share (stratified_cap; a class whose share
    rounds to none is left out rather than over-represented): the one way fedge takes a labelled subset to
    evaluate or benchmark on, never the first n of an array that may be sorted by class. The same arguments give
    the same sample."""
    pool = np.arange(len(y)) if among is None else np.asarray(among, dtype=np.int64)
    drawn = stratified_cap(np.random.default_rng(seed).permutation(pool), np.asarray(y), max(int(n), 0), False)
    return _indices([drawn])


def _split_train_test(pool: np.ndarray, y: np.ndarray, test_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Per class, the first round(n * test_fraction) samples of `pool` (random order) become test.

    A class with at least 2 samples keeps at least one in train and one in test, so the test
    set has the same class set and (up to rounding) the same label distribution as train.
    """
    labels = y[pool]
    train, test = [], []
    for c in np.unique(labels):
        members = pool[labels == c]
        n = len(members)
        n_test = min(max(_round_half_up(n * test_fraction), 1), n - 1) if n >= 2 else 0
        test.append(members[:n_test])
        train.append(members[n_test:])
    return _indices(train), _indices(test)


def make_partition(y: np.ndarray, num_classes: int, config: PartitionConfig) -> Partition:
    """Split sample indices into a stratified public set and disjoint per-client train/test shards.

    Deterministic given `config` (one `np.random.default_rng(config.seed)`). Labels that are not
    a 1-D integer array in [0, num_classes), a config the data cannot satisfy, or a client left
    without any training sample raise PartitionError saying what to change.
    """
    y = _check_labels(y, num_classes)
    rng = np.random.default_rng(config.seed)
    public, pools = _split_public(y, num_classes, config.public_fraction, rng)
    if config.max_public_samples is not None:
        public = _indices([stratified_cap(rng.permutation(public), y, config.max_public_samples)])
    shards = []
    for client_id, pool in enumerate(_ASSIGNERS[config.scheme](pools, config, rng)):
        if config.max_samples_per_client is not None:
            pool = stratified_cap(pool, y, config.max_samples_per_client)
        train, test = _split_train_test(pool, y, config.test_fraction)
        if len(train) == 0:
            raise PartitionError(
                f"client {client_id} gets no training data from {len(y)} samples with "
                f"scheme {config.scheme!r}; use fewer PartitionConfig.num_clients "
                f"(got {config.num_clients}) or more data"
            )
        shards.append(ClientShard(client_id, train, test))
    logger.debug(
        "partition %s: public %d, clients %s", config, len(public), [(len(s.train), len(s.test)) for s in shards]
    )
    return Partition(public, tuple(shards))


def client_shard(y: np.ndarray, num_classes: int, config: PartitionConfig, client_id: int) -> ClientShard:
    """One client's shard, recomputed locally from the labels and config (same as make_partition's).

    A client_id outside [0, config.num_clients) raises PartitionError; otherwise as make_partition.
    """
    if (
        isinstance(client_id, bool)
        or not isinstance(client_id, (int, np.integer))
        or not 0 <= client_id < config.num_clients
    ):
        raise PartitionError(f"client_id must be an integer in [0, {config.num_clients}), got {client_id!r}")
    return make_partition(y, num_classes, config).clients[int(client_id)]


def describe(partition: Partition, y: np.ndarray) -> list[dict[str, Any]]:
    """Per client: client, n_train, n_test, classes {label: train + test count}, train_counts, test_counts.

    Raises PartitionError if the partition's indices do not fit `y` (a different dataset).
    """
    y = np.asarray(y)
    rows = []
    for shard in partition.clients:
        if any(len(ix) and ix.max() >= len(y) for ix in (shard.train, shard.test)):
            raise PartitionError(f"client {shard.client_id}: indices exceed the {len(y)} labels given")
        train_counts = dict(zip(*(v.tolist() for v in np.unique(y[shard.train], return_counts=True))))
        test_counts = dict(zip(*(v.tolist() for v in np.unique(y[shard.test], return_counts=True))))
        labels = sorted(train_counts | test_counts)
        rows.append(
            {
                "client": shard.client_id,
                "n_train": int(len(shard.train)),
                "n_test": int(len(shard.test)),
                "classes": {c: train_counts.get(c, 0) + test_counts.get(c, 0) for c in labels},
                "train_counts": train_counts,
                "test_counts": test_counts,
            }
        )
    return rows
