"""Every registered strategy, on a homogeneous fleet all accept: plan/aggregate contracts, zero replies,
order independence, seed determinism, state that survives a checkpoint and a re-planned round, options with
defaults and help that refuse unknown keys, and a declaration of what every reply it asks for carries."""

import dataclasses

import pytest
import torch

from device_profiles import get_profile
from edge_client.agent import TASKS
from fedge.checkpoint import load_tree, save_tree, tree_digest
from fedge.config import ConfigError
from fedge.model.spec import build
from fedge.model.zoo import create
from fedge.wire.codec import encode_result
from fedge.wire.messages import ClientInfo, Result, Weights
from fedge.wire.payloads import DTYPES, Expected, payload_rejection
from server.strategy import STRATEGIES, PublicData, StrategyConfig, create_strategy, parse_options

pytestmark = pytest.mark.timeout(120)
CONFIG = StrategyConfig(local_epochs=1, batch_size=8, lr=1e-3, seed=0)
# where a strategy has these options: tiny and fast
# every_round=false: local's Local-T default plans every registered client, not the active ones (test below)
SMALL = {"finetune_epochs": 1, "finetune_min_steps": 0, "max_candidates": 2, "every_round": False}
PUBLIC = PublicData(torch.randn(24, 1, 8, 8, generator=torch.Generator().manual_seed(0)), torch.arange(24) % 10)


MODEL = {"fedmn": "fedmn_2x2x2_cnn1"}  # a strategy whose fleet must hold another model than cnn1


def fleet(n=4, model="cnn1"):
    return {
        str(i): ClientInfo(str(i), create(model, (1, 8, 8), 10).with_origin(str(i)), "rpi-4", 20, 5) for i in range(n)
    }


def make(name):
    known = {option for option, *_ in STRATEGIES.get(name).options_type.describe()}
    s = create_strategy(name, CONFIG, PUBLIC, {k: v for k, v in SMALL.items() if k in known})
    s.setup(fleet(model=MODEL.get(name, "cnn1")))
    return s


def uploads(strategy, rnd, cids):
    """Round `rnd` planned by `strategy` for `cids`, and each client's reply to its task carrying a freshly
    initialised model (seeded by the client) of every architecture the strategy expects back, and seeded tensors
    of every declared slot (floats in [0, 1), integers in 0..2, booleans true)."""
    clients, out = strategy.clients, {}
    for cid, task in strategy.plan(rnd, cids).items():
        expected, models, tensors = strategy.expects(task, clients[cid]), {}, {}
        for role, spec in expected.models.items():
            torch.manual_seed(int(cid))
            spec = (spec or clients[cid].spec).with_origin(cid)
            models[role] = Weights(spec, build(spec).state_dict())
        for tname, slot in expected.tensors.items():
            gen, dtype = torch.Generator().manual_seed(int(cid)), DTYPES[slot.dtype]
            tensors[tname] = (
                torch.rand(slot.shape, generator=gen, dtype=dtype)
                if dtype.is_floating_point
                else torch.ones(slot.shape, dtype=dtype)
                if dtype == torch.bool
                else torch.randint(0, 3, slot.shape, generator=gen, dtype=dtype)
            )
        out[cid] = Result(cid, rnd, task.type, 20, {"train_loss": 1.0 + 0.1 * int(cid)}, models, tensors=tensors)
    return out


def same_tasks(a, b):
    assert a.keys() == b.keys()
    for cid in a:
        assert a[cid].type == b[cid].type and a[cid].config == b[cid].config
        assert a[cid].models.keys() == b[cid].models.keys()
        for role, w in a[cid].models.items():
            other = b[cid].models[role].state
            assert w.state.keys() == other.keys() and all(torch.equal(w.state[k], other[k]) for k in w.state)


@pytest.fixture(params=list(STRATEGIES))
def name(request):
    return request.param


def test_plans_exactly_the_active_clients_with_known_task_types(name):
    strategy = make(name)
    tasks = strategy.plan(0, ["1", "3"])
    assert set(tasks) == {"1", "3"}
    assert all(t.type in TASKS and t.round == 0 for t in tasks.values())
    assert all(t.type in TASKS for t in strategy.evaluation(0, ["0", "1"]).values())


def test_local_t_trains_and_evaluates_every_registered_client_every_round():
    strategy = create_strategy("local", CONFIG, PUBLIC)
    strategy.setup(fleet())
    assert set(strategy.plan(0, ["1", "3"])) == {"0", "1", "2", "3"}
    replies = uploads(strategy, 0, ["1", "3"])
    assert set(replies) == {"0", "1", "2", "3"}
    strategy.aggregate(0, {cid: r for cid, r in replies.items() if cid != "2"})  # client 2's reply was refused
    assert set(strategy.evaluation(0, ["1"])) == {"0", "1", "3"}  # it trained nothing this round: not evaluated


def test_zero_and_one_replies_are_survived(name):
    strategy = make(name)
    strategy.plan(0, ["0", "2"])
    strategy.aggregate(0, {})
    strategy.aggregate(1, uploads(strategy, 1, ["2"]))
    assert set(strategy.plan(2, ["0", "2"])) == {"0", "2"}


def test_aggregation_is_order_independent_and_seed_deterministic(name):
    a, b = make(name), make(name)
    results = uploads(a, 0, ["0", "1", "2"])
    assert any(r.models or r.tensors for r in results.values()) or name == "local"
    b.plan(0, ["0", "1", "2"])
    a.aggregate(0, results)
    b.aggregate(0, dict(reversed(list(results.items()))))
    same_tasks(a.plan(1, ["0", "1", "2", "3"]), b.plan(1, ["0", "1", "2", "3"]))


def saved(tree, tmp_path):
    save_tree(tmp_path / "state.safetensors", tree)
    return load_tree(tmp_path / "state.safetensors")


def test_state_survives_a_checkpoint_and_resumes_the_same(name, tmp_path):
    a = make(name)
    a.aggregate(0, uploads(a, 0, ["0", "1", "2"]))
    b = make(name)
    b.load_state(saved(a.state(), tmp_path))
    assert tree_digest(b.state()) == tree_digest(a.state()) and b.summary() == a.summary()
    same_tasks(b.plan(1, ["0", "1", "2", "3"]), a.plan(1, ["0", "1", "2", "3"]))
    b.aggregate(1, uploads(b, 1, ["0", "3"]))
    a.aggregate(1, uploads(a, 1, ["0", "3"]))
    assert tree_digest(b.state()) == tree_digest(a.state())


def test_planning_a_round_again_changes_no_state(name):
    strategy = make(name)
    strategy.aggregate(0, uploads(strategy, 0, ["0", "1", "2"]))
    before = tree_digest(strategy.state())
    first = strategy.plan(1, ["0", "1"])
    same_tasks(strategy.plan(1, ["0", "1"]), first)
    assert tree_digest(strategy.state()) == before


def test_options_have_defaults_and_help_take_strings_and_refuse_unknown_keys(name):
    options_type = STRATEGIES.get(name).options_type
    defaults = parse_options(name, {})
    assert defaults == options_type()
    for option, _kind, default, text in options_type.describe():
        assert text, f"{name} option {option} has no help text"
        assert parse_options(name, {option: str(default)}) == defaults  # --set gives every value as a string
    with pytest.raises(ConfigError, match=r"has no option\(s\) \['no_such_option'\]"):
        parse_options(name, {"no_such_option": "1"})


def conforming(task, expected, info):
    """A reply carrying exactly what `expected` declares (a fresh model where any architecture is allowed)."""
    models = {}
    for role, spec in expected.models.items():
        spec = (spec or info.spec).with_origin(info.client_id)
        models[role] = Weights(spec, build(spec).state_dict())
    tensors = {n: torch.zeros(slot.shape, dtype=DTYPES[slot.dtype]) for n, slot in expected.tensors.items()}
    return Result(
        info.client_id,
        task.round,
        task.type,
        5,
        {"accuracy": 0.5, "loss": 1.0},
        models,
        tensors=tensors,
        records={n: [1, "a"] for n in expected.records},
    )


def test_every_task_declares_what_its_reply_carries_and_sizes_it(name):
    strategy = make(name)
    clients = strategy.clients
    strategy.aggregate(0, uploads(strategy, 0, ["0", "1", "2"]))
    profile = get_profile("rpi-4")
    for tasks in (strategy.plan(1, ["0", "1", "3"]), strategy.evaluation(1, ["0", "1", "3"])):
        for cid, task in tasks.items():
            expected = strategy.expects(task, clients[cid])
            assert isinstance(expected, Expected)
            reply = conforming(task, expected, clients[cid])
            assert payload_rejection(reply, expected, clients[cid], profile) is None
            assert len(encode_result(reply)) <= expected.reply_bytes(profile)
            extra = dataclasses.replace(reply, tensors=reply.tensors | {"undeclared": torch.zeros(1)})
            assert payload_rejection(extra, expected, clients[cid], profile)[0] == "payload"
