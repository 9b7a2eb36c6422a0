"""FedMN end to end on mnist-5k with the zoo's smallest pool, fedmn_2x2x2_cnn1 (2 cnn1 encoders, 2 + 2 MLP blocks,
10 paths), 4 clients of FedEM's clustered split, 3 rounds of which the first is the warm-up: every task carries the
router and the blocks its route reaches, every reply the router and the blocks it used, and the rows count what
went each way, the run over MQTT with client
processes gives the in-process pool and accuracies, each client's model exports to ONNX and scores its final
accuracy, a crashed run resumes bit-identically, and a client lying in its reply (an extra block, a wrong shape, a
route it was not sent, a next route without a path) is refused with its reason while the others train on."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
from typing import Any, Callable

import pytest
import torch

from edge_client.agent import ClientAgent, TaskError
from fedge.checkpoint import load_tree, tree_digest
from fedge.model import zoo
from fedge.model.spec import tensor_shapes
from fedge.model.weights import load_model
from fedge.wire.messages import Result, Task
from launch.simulation import run_simulation
from methods.fedmn.modular import NEXT_ROUTE, ROUTE, ROUTING
from server.runlog import CHECKPOINT_FILE

from helpers.federation import (
    Crash,
    crash_at,
    exports_score_their_accuracy,
    fedge_run_processes,
    make_config,
    read_rows,
    rows_without_wall_clock,
    run_inproc,
)

pytestmark = pytest.mark.timeout(600)
UNITS = (2, 2, 2)  # fedmn_2x2x2_cnn1: 2 encoders, then 2 blocks, then 2 output blocks
PATHS = 2 * 2 + 2 * 2 + 2  # §II-A: Σ n_l n_{l+1} + n_L
CLIENTS, ROUNDS, WARMUP = 4, 3, 1
FLOAT = 4
PREFIX = "blocks.0.0."
PRIVATE = ("routing",)  # the client's own most likely route, never exchanged


def fleet(out, **kw):
    """4 clients on fedmn_2x2x2_cnn1, FedEM's clustered split, 3 rounds, the first with every path on."""
    settings = {
        "strategy": "fedmn",
        "zoo": "fedmn_2x2x2_cnn1",
        "clients": CLIENTS,
        "rounds": ROUNDS,
        "partition": "clustered",
        "warmup_rounds": WARMUP,
    }
    return make_config(out, **(settings | kw))


# ---------------------------------------------------------------------------------------------- routes, by hand
# Independent of methods/fedmn/modular.py: a path's index from the layout its docstring states, a block's tensors from
# its state name, the blocks a route uses as those on a complete chain input → encoder → ... → output, and the blocks it
# reaches as every encoder and what a path that is on leads to from a reached block.


def path_index(layer: int, j: int, k: int) -> int:
    """The path from block k of layer `layer` - 1 to block j of layer `layer` (layers from 1, the encoders)."""
    offset = sum(a * b for a, b in zip(UNITS[: layer - 2], UNITS[1 : layer - 1]))
    return offset + j * UNITS[layer - 2] + k


def output_index(j: int) -> int:
    return sum(a * b for a, b in zip(UNITS, UNITS[1:])) + j


def used(route: list[bool]) -> set[tuple[int, int]]:
    """(layer, index) of every block on a chain whose every path is on."""
    out: set[tuple[int, int]] = set()
    for chain in itertools.product(*(range(n) for n in UNITS)):
        links = [path_index(layer, chain[layer - 1], chain[layer - 2]) for layer in range(2, len(UNITS) + 1)]
        if all(route[i] for i in links) and route[output_index(chain[-1])]:
            out |= {(layer, j) for layer, j in enumerate(chain, start=1)}
    return out


def reached(route: list[bool]) -> set[tuple[int, int]]:
    """(layer, index) of every block whose input is not 0: the encoders, then blocks a path on leads to."""
    out = {(1, j) for j in range(UNITS[0])}
    for layer in range(2, len(UNITS) + 1):
        out |= {
            (layer, j)
            for j in range(UNITS[layer - 1])
            for k in range(UNITS[layer - 2])
            if route[path_index(layer, j, k)] and (layer - 1, k) in out
        }
    return out


def part(name: str) -> tuple[int, int] | str:
    """A state tensor's block (layer, index), "router", or "private"."""
    rest = name.removeprefix(PREFIX).split(".")
    if rest[0] == "encoders":
        return 1, int(rest[1])
    if rest[0] == "layers":
        return int(rest[1]) + 2, int(rest[2])
    return "router" if rest[0] == "router" else "private"


SHAPES = {n: s for n, (s, _) in tensor_shapes(zoo.create("fedmn_2x2x2_cnn1", (1, 28, 28), 10)).items()}
ALL_BLOCKS = {(layer, j) for layer, n in enumerate(UNITS, start=1) for j in range(n)}


def sent_names(route: list[bool]) -> set[str]:
    """The tensors of a task on `route`: the router's and those of the blocks the route reaches."""
    blocks = reached(route)
    return {n for n in SHAPES if part(n) == "router" or part(n) in blocks}


def uploaded_names(route: list[bool]) -> set[str]:
    """The tensors of a reply on `route`: the router's and those of the blocks the route used."""
    blocks = used(route)
    return {n for n in SHAPES if part(n) == "router" or part(n) in blocks}


def numbers(names) -> int:
    return sum(math.prod(SHAPES[n]) for n in names)


POOL = numbers(sent_names([True] * PATHS))  # the whole pool with its router: what the warm-up exchanges each way


def bits(t: torch.Tensor) -> str:
    return "".join("1" if v else "0" for v in t.tolist())


def test_the_layout_by_hand_matches_the_pool():
    assert len(SHAPES) == len(set(SHAPES)) and {part(n) for n in SHAPES} == ALL_BLOCKS | {"router", "private"}
    assert {n.removeprefix(PREFIX) for n in SHAPES if part(n) == "private"} == set(PRIVATE)
    assert SHAPES[PREFIX + "routing"] == (PATHS,)
    assert used([True] * PATHS) == ALL_BLOCKS and used([False] * PATHS) == set()
    chain = [False] * PATHS  # encoder 1 → block (2, 0) → block (3, 1) → output
    for i in (path_index(2, 0, 1), path_index(3, 1, 0), output_index(1)):
        chain[i] = True
    assert used(chain) == {(1, 1), (2, 0), (3, 1)}
    dangling = chain.copy()  # encoder 0 → block (2, 1), which feeds nothing: not used
    dangling[path_index(2, 1, 0)] = True
    assert used(dangling) == used(chain)
    assert reached(chain) == {(1, 0), (1, 1), (2, 0), (3, 1)} and reached(dangling) == reached(chain) | {(2, 1)}


# ---------------------------------------------------------------------------------------------- the reference run


def recording(monkeypatch) -> dict[tuple[int, str], tuple[Task, Result]]:
    """Every modular_train task as its client received it, and the client's honest reply, by (round, client)."""
    handle, tasks = ClientAgent.handle, {}

    def recorded(agent: ClientAgent, task: Task) -> Result:
        res = handle(agent, task)
        if task.type == "modular_train":
            tasks[(task.round, agent.client_id)] = (task, res)
        return res

    monkeypatch.setattr(ClientAgent, "handle", recorded)
    return tasks


@pytest.fixture(scope="module")
def fedmn_run(tmp_path_factory):
    """One in-process FedMN run (the reference of the MQTT run), its folder and its clients' training tasks."""
    out = tmp_path_factory.mktemp("fedmn") / "run"
    with pytest.MonkeyPatch.context() as monkeypatch:
        tasks = recording(monkeypatch)
        summary = run_inproc(fleet(out))
    return summary, out, tasks


def test_each_client_exchanges_the_router_and_its_routes_blocks_and_the_rows_count_them(fedmn_run):
    """In process: nothing refused, every client trains every round. A task carries the router and exactly the
    blocks its route reaches (the whole pool in the warm-up; after it, the route the client sampled at the end of its
    previous task), the reply the router and the blocks the route used, and the row's params_down/params_up and
    bytes count them: a client routed through fewer blocks uploads fewer numbers than the whole pool. The row's
    `routing` is the client's most likely route after training (what it is evaluated and exported with) and
    `blocks_used` the blocks on it."""
    summary, out, tasks = fedmn_run
    clients = [str(c) for c in range(CLIENTS)]
    assert summary["rejected_replies"] == {} and summary["rejected_messages"] == {}
    assert summary["never_trained"] == [] and summary["discarded_aggregates"] == [] and summary["failed_rounds"] == []
    assert summary["pool"] == list(UNITS) and summary["paths"] == PATHS
    assert sorted(tasks) == [(r, c) for r in range(ROUNDS) for c in clients]

    rows = read_rows(out)
    assert sorted((r["round"], r["client"]) for r in rows) == sorted(tasks)
    fewer = 0
    for r in rows:
        task, reply = tasks[(r["round"], r["client"])]
        route = task.tensors[ROUTE]
        assert r["trained"] and 0 <= r["accuracy"] <= 1, r
        assert route.dtype == torch.bool and tuple(route.shape) == (PATHS,) and used(route.tolist())
        if r["round"] < WARMUP:  # the warm-up: every path on, the router untouched, FedAvg of the whole pool
            assert route.all() and not task.config["learn_routing"]
        else:  # the route the client sampled at the end of its previous task, with its router learning
            assert task.config["learn_routing"]
        # the task holds the router and exactly the blocks the route reaches, the reply those it used, and the row
        # counts them
        assert set(task.tensors) - {ROUTE} == sent_names(route.tolist()), (r["round"], r["client"], bits(route))
        assert set(reply.tensors) - {ROUTE, NEXT_ROUTE, ROUTING} == uploaded_names(route.tolist())
        down, n = numbers(sent_names(route.tolist())), numbers(uploaded_names(route.tolist()))
        assert r["params_down"] == down and r["params_up"] == n <= down <= POOL
        assert n == POOL if used(route.tolist()) == ALL_BLOCKS else n < POOL
        # ... and so do the bytes on the wire: 4 bytes a number, plus the envelope and the reply's metrics
        assert FLOAT * down < r["bytes_down"] < FLOAT * down + 16 * 1024
        assert FLOAT * n < r["bytes_up"] < FLOAT * n + 16 * 1024
        # the reply repeats the route; the row shows the client's most likely route after its training (one bit
        # per path, with a path to the output)
        assert torch.equal(reply.tensors[ROUTE], route) and reply.tensors[ROUTING].dtype == torch.bool
        assert re.fullmatch(f"[01]{{{PATHS}}}", r["routing"]) and r["routing"] == bits(reply.tensors[ROUTING])
        assert r["blocks_used"] == len(used([c == "1" for c in r["routing"]])) >= len(UNITS)
        if n < POOL:
            fewer += 1
            warmup = next(w for w in rows if w["round"] == 0 and w["client"] == r["client"])
            assert r["bytes_up"] < warmup["bytes_up"]
    assert all(r["params_down"] == r["params_up"] == POOL for r in rows if r["round"] < WARMUP)
    assert fewer > 0  # some client routed through fewer blocks after the warm-up and sent less (the point of §II-E)
    assert 0 < summary["network_bytes_total"] == sum(r["bytes_down"] + r["bytes_up"] for r in rows)

    # after the warm-up, a client's route for round t is the next route it sampled at the end of round t - 1
    for (rnd, cid), (task, _) in tasks.items():
        if rnd >= WARMUP:
            assert torch.equal(task.tensors[ROUTE], tasks[(rnd - 1, cid)][1].tensors[NEXT_ROUTE]), (rnd, cid)
    last = {r["client"]: r["routing"] for r in rows if r["round"] == ROUNDS - 1}
    assert summary["routing"] == last
    assert summary["distinct_routes"] == len(set(last.values()))
    assert sum(summary["route_counts"].values()) == CLIENTS and set(summary["route_counts"]) == set(last.values())
    assert set(summary["final_accuracy"]["per_client"]) == set(clients)


# ---------------------------------------------------------------------------------------------- MQTT, export


def test_over_mqtt_with_client_processes_it_matches_the_inproc_run(fedmn_run, tmp_path):
    """`fedge run` on the embedded broker, clients as 2 processes: nothing is refused, and the pool, the routes and
    the accuracies are the in-process run's, bit for bit."""
    inproc, inproc_out, _ = fedmn_run
    cfg = fleet(tmp_path / "mqtt", transport="mqtt", round_deadline_s=120.0, register_timeout_s=120.0, run_id="mn")
    done = fedge_run_processes(cfg, tmp_path / "mqtt.json", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "mqtt" / "summary.json").read_text())
    assert not summary["rejected_messages"] and not summary["rejected_replies"] and not summary["never_trained"]
    rows = read_rows(tmp_path / "mqtt")
    assert len(rows) == ROUNDS * CLIENTS and all(r["trained"] for r in rows)
    assert summary["final_accuracy"]["per_client"] == inproc["final_accuracy"]["per_client"]
    assert summary["routing"] == inproc["routing"]
    fields = ("round", "client", "routing", "blocks_used", "params_down", "params_up", "accuracy", "loss")
    mqtt_rows, inproc_rows = (
        sorted(([r.get(k) for k in fields] for r in read_rows(o)), key=str) for o in (tmp_path / "mqtt", inproc_out)
    )
    assert mqtt_rows == inproc_rows
    a, b = (load_tree(out / CHECKPOINT_FILE)["strategy_state"] for out in (tmp_path / "mqtt", inproc_out))
    assert tree_digest(a) == tree_digest(b)


def test_each_clients_model_exports_to_onnx_and_scores_its_final_accuracy(fedmn_run, tmp_path):
    """`fedge export --what model` takes the client's final model (the global pool with its own routing), checks
    ONNX parity, and the exported model scores on the client's test shard what the run reported for it."""
    summary, out, _ = fedmn_run
    assert exports_score_their_accuracy(out, summary, "model", "mnist-5k", tmp_path) == CLIENTS


def test_the_final_models_are_the_global_pool_with_each_clients_routing(fedmn_run):
    """What the run leaves per client (<run>/models/<cid>/model.safetensors, what `fedge export --what model`
    reads): the checkpoint's global pool and router, and in `routing` the client's most likely route of the
    summary."""
    summary, out, _ = fedmn_run
    pool = load_tree(out / CHECKPOINT_FILE)["strategy_state"]["global"].state
    for cid in map(str, range(CLIENTS)):
        spec, state = load_model(out / "models" / cid / "model.safetensors")
        assert spec.name == "fedmn_2x2x2_cnn1" and set(state) == set(SHAPES)
        assert bits(state[PREFIX + "routing"]) == summary["routing"][cid]
        for name in SHAPES:
            if part(name) != "private":
                assert torch.equal(state[name], pool[name]), name


# ---------------------------------------------------------------------------------------------- resume


def test_a_crashed_run_resumes_bit_identically(tmp_path, monkeypatch):
    def config(out):
        return fleet(out, transport="inproc")

    straight = run_simulation(config(tmp_path / "straight"), progress=False)
    crash_at(monkeypatch, rnd=2, nth=2)  # in a routed round, after client 0 trained on its sampled route
    with pytest.raises(Crash):
        run_simulation(config(tmp_path / "crashed"), progress=False)
    monkeypatch.undo()
    resumed = run_simulation(config(tmp_path / "crashed"), progress=False, resume=True)

    assert resumed["final_accuracy"] == straight["final_accuracy"]
    assert resumed["routing"] == straight["routing"]
    a, b = (load_tree(tmp_path / run / CHECKPOINT_FILE) for run in ("straight", "crashed"))
    assert tree_digest(a["strategy_state"]) == tree_digest(b["strategy_state"])
    assert rows_without_wall_clock(tmp_path / "crashed") == rows_without_wall_clock(tmp_path / "straight")


# ---------------------------------------------------------------------------------------------- a lying client

LIAR = "1"


def extra_block(agent: ClientAgent, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The reply also uploads a block its route does not use (None when the route uses every block)."""
    state = agent.model.state_dict()
    unused = sorted(n for n in state if isinstance(part(n), tuple) and part(n) not in used(t[ROUTE].tolist()))
    if not unused:
        return None
    block = part(unused[0])
    return t | {n: state[n].clone() for n in unused if part(n) == block}


def wrong_shape(agent: ClientAgent, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    name = next(n for n in t if part(n) == "router" and t[n].dim() == 2)
    return t | {name: t[name][:-1].clone()}


def other_route(agent: ClientAgent, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Claims another route than the task's (one path flipped; the uploaded blocks are left as they are)."""
    route = t[ROUTE].clone()
    route[output_index(0)] = not route[output_index(0)]
    return t | {ROUTE: route}


def no_path(agent: ClientAgent, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A next route that connects no encoder to the output (every output path off)."""
    route = t[NEXT_ROUTE].clone()
    route[output_index(0) :] = False
    return t | {NEXT_ROUTE: route}


LIES: dict[str, Callable[[ClientAgent, dict[str, torch.Tensor]], Any]] = {
    "payload": extra_block,
    "tensors": wrong_shape,
    "route": other_route,
    "route-no-path": no_path,
}


def lying(monkeypatch, lie) -> tuple[dict[tuple[int, str], tuple[Task, Result]], list[int]]:
    """Client LIAR trains honestly, and from the first routed round on edits its every modular_train reply with `lie`
    (with lie None: fails the task after training, so its reply never arrives). Returns the recorded tasks and the
    rounds it lied in."""
    tasks = recording(monkeypatch)
    handle, lied = ClientAgent.handle, []

    def edited(agent: ClientAgent, task: Task) -> Result:
        res = handle(agent, task)
        if agent.client_id != LIAR or task.type != "modular_train" or task.round < WARMUP:
            return res
        if lie is None:
            raise TaskError("the liar's reply is lost")
        tensors = lie(agent, dict(res.tensors))
        if tensors is None:
            return res
        lied.append(task.round)
        return dataclasses.replace(res, tensors=tensors)

    monkeypatch.setattr(ClientAgent, "handle", edited)
    return tasks, lied


@pytest.fixture(scope="module")
def lost_replies(tmp_path_factory):
    """The run in which the liar's replies after the warm-up are lost instead: what a refused reply must leave."""
    out = tmp_path_factory.mktemp("lost") / "run"
    with pytest.MonkeyPatch.context() as monkeypatch:
        tasks, _ = lying(monkeypatch, None)
        summary = run_inproc(fleet(out))
    return summary, out, tasks


@pytest.mark.parametrize("lie", list(LIES))
def test_a_lying_client_is_refused_with_its_reason_and_the_others_train_on(tmp_path, monkeypatch, lie, lost_replies):
    """In process: the liar's replies of the routed rounds are refused with the lie's code; the other clients
    train every round, and the pool and the routes are those of a run where the liar's replies were lost."""
    lost, lost_out, lost_tasks = lost_replies
    tasks, lied = lying(monkeypatch, LIES[lie])
    summary = run_inproc(fleet(tmp_path / "run"))
    out = tmp_path / "run"

    assert lied == list(range(WARMUP, ROUNDS))  # it could lie in every routed round
    assert summary["rejected_replies"] == {lie.split("-")[0]: len(lied)}
    assert summary["never_trained"] == [] and summary["rejected_messages"] == {}
    trained = sorted((r["round"], r["client"]) for r in read_rows(out) if r["trained"])
    assert trained == [(r, c) for r in range(ROUNDS) for c in map(str, range(CLIENTS)) if r < WARMUP or c != LIAR]
    # the server kept the route the liar sampled in the warm-up (its refused replies' next routes were not taken)
    sampled = tasks[(WARMUP - 1, LIAR)][1].tensors[NEXT_ROUTE]
    assert all(torch.equal(tasks[(r, LIAR)][0].tensors[ROUTE], sampled) for r in range(WARMUP, ROUNDS))
    # nothing of the refused replies reached the pool, the router or the routes: the run is the lost-replies run
    assert sorted(lost_tasks) == sorted(tasks)
    for key in tasks:
        assert torch.equal(tasks[key][0].tensors[ROUTE], lost_tasks[key][0].tensors[ROUTE]), key
    a, b = (load_tree(o / CHECKPOINT_FILE)["strategy_state"] for o in (out, lost_out))
    assert tree_digest(a) == tree_digest(b)
    assert summary["final_accuracy"] == lost["final_accuracy"] and summary["routing"] == lost["routing"]
    assert rows_without_wall_clock(out) == rows_without_wall_clock(lost_out)
