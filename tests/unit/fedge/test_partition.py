"""Tests for fedge.data.partition: public set, client shards, schemes, caps and config validation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedge.constants import PUBLIC_FRACTION, TEST_FRACTION_OF_CLIENT
from fedge.data.datasets import load_dataset
from fedge.data.partition import (
    SCHEMES,
    Partition,
    PartitionConfig,
    PartitionError,
    client_shard,
    describe,
    make_partition,
    stratified_sample,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def y() -> np.ndarray:
    """mnist-5k labels: 500 per class."""
    return np.asarray(load_dataset("mnist-5k").y)


def _all_client_indices(partition: Partition) -> list[np.ndarray]:
    return [ix for shard in partition.clients for ix in (shard.train, shard.test)]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_public_and_all_client_sets_are_disjoint(y: np.ndarray, scheme: str) -> None:
    partition = make_partition(y, 10, PartitionConfig(scheme, 10))

    parts = [partition.public, *_all_client_indices(partition)]
    pooled = np.concatenate(parts)

    assert len(np.unique(pooled)) == len(pooled)
    assert len(pooled) == len(y)  # nothing lost for 10 clients x 2 classes / iid / dirichlet
    for ix in parts:
        assert ix.dtype == np.int64 and np.all(np.diff(ix) > 0) and not ix.flags.writeable


def test_public_set_is_8_percent_of_every_class(y: np.ndarray) -> None:
    partition = make_partition(y, 10, PartitionConfig("iid", 5))

    assert PUBLIC_FRACTION == 0.08
    assert np.bincount(y[partition.public], minlength=10).tolist() == [40] * 10  # round(500 * 0.08)


def test_noniid_overall_split_is_exactly_72_20_8(y: np.ndarray) -> None:
    partition = make_partition(y, 10, PartitionConfig("noniid", 10))

    # per class: 40 public, 460 left -> 230 for each of its 2 holders -> 50 test (230 * 0.2 / 0.92)
    assert len(partition.public) == 400
    assert sum(len(s.test) for s in partition.clients) == 1000
    assert sum(len(s.train) for s in partition.clients) == 3600
    assert all((len(s.train), len(s.test)) == (360, 100) for s in partition.clients)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_overall_ratios_are_close_to_72_20_8(y: np.ndarray, scheme: str) -> None:
    partition = make_partition(y, 10, PartitionConfig(scheme, 8, seed=3))

    n = len(y)
    assert len(partition.public) / n == pytest.approx(0.08, abs=0.002)
    assert sum(len(s.test) for s in partition.clients) / n == pytest.approx(0.20, abs=0.01)
    assert sum(len(s.train) for s in partition.clients) / n == pytest.approx(0.72, abs=0.01)


@pytest.mark.parametrize(("clients", "k"), [(10, 2), (7, 3), (20, 2), (4, 1)])
def test_noniid_gives_exactly_k_classes_in_train_and_test(y: np.ndarray, clients: int, k: int) -> None:
    partition = make_partition(y, 10, PartitionConfig("noniid", clients, classes_per_client=k, seed=1))

    for shard in partition.clients:
        train_classes, test_classes = set(y[shard.train]), set(y[shard.test])
        assert len(train_classes) == k and test_classes == train_classes
        for c in train_classes:  # test label distribution follows train's
            n_train, n_test = np.sum(y[shard.train] == c), np.sum(y[shard.test] == c)
            assert n_test / (n_train + n_test) == pytest.approx(TEST_FRACTION_OF_CLIENT, abs=0.01)


@pytest.mark.parametrize(("clients", "k", "low", "high"), [(10, 2, 2, 2), (7, 3, 2, 3), (3, 2, 0, 1)])
def test_noniid_class_coverage_is_balanced(y: np.ndarray, clients: int, k: int, low: int, high: int) -> None:
    partition = make_partition(y, 10, PartitionConfig("noniid", clients, classes_per_client=k))

    holders = np.zeros(10, dtype=int)
    for shard in partition.clients:
        holders[sorted(set(y[shard.train]))] += 1
    assert holders.min() == low and holders.max() == high
    assert holders.sum() == clients * k


def test_noniid_class_pairs_vary_between_seeds(y: np.ndarray) -> None:
    pairs = {
        tuple(sorted(set(y[s.train])))
        for seed in range(5)
        for s in make_partition(y, 10, PartitionConfig("noniid", 10, seed=seed)).clients
    }
    assert len(pairs) > 10


def test_iid_clients_see_all_classes_in_equal_shares(y: np.ndarray) -> None:
    partition = make_partition(y, 10, PartitionConfig("iid", 10))

    sizes = [len(s.train) + len(s.test) for s in partition.clients]
    assert sizes == [460] * 10  # 4600 non-public samples / 10
    for shard in partition.clients:
        assert set(y[shard.train]) == set(range(10)) and set(y[shard.test]) == set(range(10))


def test_dirichlet_is_deterministic_and_skewed(y: np.ndarray) -> None:
    config = PartitionConfig("dirichlet", 10, alpha=0.1, seed=7)
    a, b = make_partition(y, 10, config), make_partition(y, 10, config)

    for sa, sb in zip(a.clients, b.clients):
        assert np.array_equal(sa.train, sb.train) and np.array_equal(sa.test, sb.test)
    assert min(len(s.train) + len(s.test) for s in a.clients) >= 10
    skewed = np.mean([len(set(y[s.train])) for s in a.clients])
    flat = np.mean(
        [
            len(set(y[s.train]))
            for s in make_partition(y, 10, PartitionConfig("dirichlet", 10, alpha=100.0, seed=7)).clients
        ]
    )
    assert flat == 10 and skewed < 8


def test_clustered_splits_each_class_group_over_the_clients_by_one_dirichlet_draw() -> None:
    """FedEM's split: 10 classes in 3 groups; within a group every class is spread over the clients in the same
    proportions (one Dir(alpha) draw per group, on the group's samples in random order), and the groups differ."""
    labels = np.repeat(np.arange(10), 2000)
    config = PartitionConfig("clustered", 8, alpha=0.4, label_clusters=3, seed=3, public_fraction=0.0)
    partition = make_partition(labels, 10, config)
    shards = [np.concatenate([s.train, s.test]) for s in partition.clients]
    assert sorted(np.concatenate(shards).tolist()) == list(range(len(labels)))  # disjoint, every sample once
    shares = np.array([[np.mean(labels[shard] == c) * len(shard) / 2000 for c in range(10)] for shard in shards])
    assert np.allclose(shares.sum(0), 1)  # column c: how class c is spread over the 8 clients
    groups: list[list[int]] = []  # classes spread alike belong to one group
    for c in range(10):
        home = next((g for g in groups if np.abs(shares[:, g[0]] - shares[:, c]).max() < 0.05), None)
        if home is None:
            groups.append([c])
        else:
            home.append(c)
    assert sorted(len(g) for g in groups) == [3, 3, 4]
    assert make_partition(labels, 10, config).clients[5].train.tolist() == partition.clients[5].train.tolist()
    with pytest.raises(PartitionError, match=r"label_clusters=11 exceeds the 10 classes"):
        make_partition(labels, 10, PartitionConfig("clustered", 8, label_clusters=11))
    with pytest.raises(PartitionError, match=r"label_clusters must be an integer >= 1"):
        PartitionConfig("clustered", 8, label_clusters=0)


def test_dirichlet_gives_up_with_a_clear_message(y: np.ndarray) -> None:
    with pytest.raises(PartitionError, match=r"larger PartitionConfig.alpha"):
        make_partition(y, 10, PartitionConfig("dirichlet", 200, alpha=0.001))
    with pytest.raises(PartitionError, match="fewer clients"):
        make_partition(y[:100], 10, PartitionConfig("dirichlet", 20))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_same_seed_same_arrays_other_seed_differs(y: np.ndarray, scheme: str) -> None:
    first = make_partition(y, 10, PartitionConfig(scheme, 6, seed=11))
    again = make_partition(y, 10, PartitionConfig(scheme, 6, seed=11))
    other = make_partition(y, 10, PartitionConfig(scheme, 6, seed=12))

    assert np.array_equal(first.public, again.public)
    for s1, s2 in zip(first.clients, again.clients):
        assert np.array_equal(s1.train, s2.train) and np.array_equal(s1.test, s2.test)
    assert not np.array_equal(first.public, other.public)
    assert not np.array_equal(first.clients[0].train, other.clients[0].train)


def test_partition_does_not_touch_global_rng(y: np.ndarray) -> None:
    np.random.seed(0)
    expected = np.random.rand()
    np.random.seed(0)
    make_partition(y, 10, PartitionConfig("dirichlet", 5))
    assert np.random.rand() == expected


@pytest.mark.parametrize("scheme", SCHEMES)
def test_client_shard_matches_make_partition(y: np.ndarray, scheme: str) -> None:
    config = PartitionConfig(scheme, 5, seed=4)
    partition = make_partition(y, 10, config)

    for client_id in range(5):
        shard = client_shard(y, 10, config, client_id)
        assert shard.client_id == client_id
        assert np.array_equal(shard.train, partition.clients[client_id].train)
        assert np.array_equal(shard.test, partition.clients[client_id].test)


@pytest.mark.parametrize("client_id", [-1, 5, True, 1.0])
def test_client_shard_rejects_bad_ids(y: np.ndarray, client_id: object) -> None:
    with pytest.raises(PartitionError, match="client_id"):
        client_shard(y, 10, PartitionConfig("iid", 5), client_id)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"scheme": "pathological"}, "scheme"),
        ({"num_clients": 0}, "num_clients"),
        ({"num_clients": 2.5}, "num_clients"),
        ({"classes_per_client": 0}, "classes_per_client"),
        ({"alpha": 0.0}, "alpha"),
        ({"alpha": math.nan}, "alpha"),
        ({"alpha": math.inf}, "alpha"),
        ({"public_fraction": 1.0}, "public_fraction"),
        ({"public_fraction": -0.1}, "public_fraction"),
        ({"test_fraction": 0.0}, "test_fraction"),
        ({"test_fraction": 1.0}, "test_fraction"),
        ({"seed": -1}, "seed"),
        ({"max_samples_per_client": 0}, "max_samples_per_client"),
        ({"max_samples_per_client": True}, "max_samples_per_client"),
    ],
)
def test_bad_config_names_the_field(overrides: dict[str, object], field: str) -> None:
    kwargs: dict[str, object] = {"scheme": "iid", "num_clients": 4, **overrides}
    with pytest.raises(PartitionError, match=rf"PartitionConfig\.{field}"):
        PartitionConfig(**kwargs)  # type: ignore[arg-type]


def test_more_classes_per_client_than_classes_is_rejected(y: np.ndarray) -> None:
    with pytest.raises(PartitionError, match=r"classes_per_client=11 .*allowed 1\.\.10"):
        make_partition(y, 10, PartitionConfig("noniid", 4, classes_per_client=11))


def test_public_fraction_zero_is_allowed(y: np.ndarray) -> None:
    partition = make_partition(y, 10, PartitionConfig("iid", 4, public_fraction=0.0))
    assert len(partition.public) == 0


@pytest.mark.parametrize(
    ("labels", "num_classes", "match"),
    [
        (np.zeros((4, 2), np.int64), 10, "1-D integer"),
        (np.zeros(4, np.float32), 10, "1-D integer"),
        (np.array([0, 1, 10]), 10, r"\[0, 10\)"),
        (np.array([0, 1]), 0, "num_classes"),
    ],
)
def test_bad_labels_are_rejected(labels: np.ndarray, num_classes: int, match: str) -> None:
    with pytest.raises(PartitionError, match=match):
        make_partition(labels, num_classes, PartitionConfig("iid", 1))


def test_too_many_clients_for_the_data_is_rejected() -> None:
    labels = np.repeat(np.arange(2), 10)  # 20 samples
    with pytest.raises(PartitionError, match="num_clients"):
        make_partition(labels, 2, PartitionConfig("iid", 30))


def test_max_samples_per_client_keeps_class_proportions(y: np.ndarray) -> None:
    partition = make_partition(y, 10, PartitionConfig("noniid", 10, max_samples_per_client=50))

    for shard in partition.clients:
        # 230 + 230 capped to 25 + 25; per class round(25 * 0.2 / 0.92) = 5 test, 20 train
        assert (len(shard.train), len(shard.test)) == (40, 10)
        assert len(set(y[shard.train])) == 2 and set(y[shard.test]) == set(y[shard.train])


def test_max_samples_per_client_with_dirichlet(y: np.ndarray) -> None:
    uncapped = make_partition(y, 10, PartitionConfig("dirichlet", 5, alpha=0.5, seed=2))
    capped = make_partition(y, 10, PartitionConfig("dirichlet", 5, alpha=0.5, seed=2, max_samples_per_client=100))

    for full, small in zip(uncapped.clients, capped.clients):
        assert len(small.train) + len(small.test) == 100
        assert set(y[small.train]) | set(y[small.test]) == set(y[full.train]) | set(y[full.test])
        assert set(small.train) <= set(full.train) | set(full.test)
        full_share = np.bincount(y[np.concatenate([full.train, full.test])], minlength=10) / (
            len(full.train) + len(full.test)
        )
        small_share = np.bincount(y[np.concatenate([small.train, small.test])], minlength=10) / 100
        assert np.abs(full_share - small_share).max() <= 0.02  # +-1 sample of 100 per class


def test_describe_reports_counts_per_client(y: np.ndarray) -> None:
    partition = make_partition(y, 10, PartitionConfig("noniid", 10))

    rows = describe(partition, y)

    assert [r["client"] for r in rows] == list(range(10))
    first = rows[0]
    assert (first["n_train"], first["n_test"]) == (360, 100)
    assert len(first["classes"]) == 2 and set(first["classes"].values()) == {230}
    assert first["train_counts"] == {c: 180 for c in first["classes"]}
    assert first["test_counts"] == {c: 50 for c in first["classes"]}
    assert set(first["classes"]) == set(y[partition.clients[0].train].tolist())
    with pytest.raises(PartitionError, match="indices exceed"):
        describe(partition, y[:100])


def test_max_public_samples_caps_the_public_set_keeping_classes():
    y = np.repeat(np.arange(10), 200)
    full = make_partition(y, 10, PartitionConfig("iid", 4, seed=3))
    capped = make_partition(y, 10, PartitionConfig("iid", 4, seed=3, max_public_samples=50))
    assert len(capped.public) == 50 and set(capped.public) <= set(full.public)
    assert np.bincount(y[capped.public], minlength=10).tolist() == [5] * 10
    lowest = [np.sort(full.public[y[full.public] == c])[:5] for c in range(10)]
    assert not np.array_equal(np.sort(np.concatenate(lowest)), capped.public)  # a random subset, not the first
    with pytest.raises(PartitionError, match="max_public_samples"):
        PartitionConfig("iid", 4, max_public_samples=0)


@pytest.mark.parametrize("n", [1, 7, 64, 500, 1234])
def test_a_stratified_sample_of_a_class_sorted_set_keeps_its_proportions(y: np.ndarray, n: int) -> None:
    skewed = np.sort(np.concatenate([y, np.full(700, 3), np.full(13, 9)]))  # sorted by class, shares unequal
    rare = np.repeat(np.arange(10), [5991] + [1] * 9)  # nine classes whose share of a small sample rounds to none
    for labels in (y, skewed, rare):
        idx = stratified_sample(labels, n, seed=5)
        share = np.bincount(labels, minlength=10) * n / len(labels)
        got = np.bincount(labels[idx], minlength=10)
        assert len(idx) == n and len(set(idx.tolist())) == n and np.all(np.diff(idx) > 0)
        assert np.abs(got - share).max() < 1, (got, share)  # every class within one sample of its share
        assert np.array_equal(idx, stratified_sample(labels, n, seed=5))  # the same seed, the same sample
        assert not np.array_equal(idx, stratified_sample(labels, n, seed=6))
        assert not np.array_equal(idx, np.arange(n))  # never the first n


def test_a_stratified_sample_draws_among_given_indices_and_stops_at_their_number(y: np.ndarray) -> None:
    among = np.flatnonzero(np.isin(y, [2, 7]))
    idx = stratified_sample(y, 100, seed=0, among=among)
    assert set(idx.tolist()) <= set(among.tolist()) and np.bincount(y[idx], minlength=10)[[2, 7]].tolist() == [50, 50]
    assert np.array_equal(stratified_sample(y, 5000, seed=0, among=among), among)  # fewer than n: all of them
