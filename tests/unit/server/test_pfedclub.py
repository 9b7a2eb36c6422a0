"""pFedClub's server half: teachers kept, pFedClub+ bound on whole models and fallback, records, ablations."""

import logging

import numpy as np
import pytest
import torch

from fedge.config import ConfigError
from fedge.model.layers import LayerSpec as L
from fedge.model.spec import build, make_spec
from fedge.model.zoo import create
from fedge.seeding import derive_seed
from fedge.tasks import TrainTask
from fedge.wire.messages import ClientInfo, Result, Weights
from methods.pfedclub.server import own_io
from methods.reassembly.assemble import assemble, candidate_spec
from methods.reassembly.finetune import best_match, finetune_candidates, public_logits
from methods.reassembly.strategy import Pool
from server.strategy import PublicData, StrategyConfig, StrategyError, create_strategy

pytestmark = pytest.mark.timeout(120)
MODELS = {"0": "cnn1", "1": "cnn2", "2": "cnn1", "3": "mobilenet_v1"}
PUBLIC = PublicData(torch.randn(32, 1, 8, 8, generator=torch.Generator().manual_seed(0)), torch.arange(32) % 10)


CONFIG = StrategyConfig(local_epochs=1, batch_size=8, lr=1e-3, seed=0)


def spec(cid):
    return create(MODELS[cid], (1, 8, 8), 10).with_origin(cid)


def make(name, **options):
    cap = {"max_candidates": 2} if name.startswith("pfedclub") else {}
    s = create_strategy(name, CONFIG, PUBLIC, {"finetune_epochs": 1, "finetune_min_steps": 0} | cap | options)
    s.setup({cid: ClientInfo(cid, spec(cid), "rpi-4", 20, 5) for cid in MODELS})
    return s


def uploads(rnd, cids):
    out = {}
    for cid in cids:
        torch.manual_seed(int(cid))
        out[cid] = Result(cid, rnd, "kd_train", 20, {}, {"local": Weights(spec(cid), build(spec(cid)).state_dict())})
    return out


def test_first_participation_has_no_teacher_and_teachers_are_kept_until_next_selection():
    s = make("pfedclub")
    assert all(not t.models for t in s.plan(0, ["0", "1", "3"]).values())
    s.aggregate(0, uploads(0, ["0", "1", "3"]))
    teacher = s.teachers["0"]
    s.plan(1, ["2", "3"])
    s.aggregate(1, uploads(1, ["2", "3"]))  # rounds pass without client 0
    s.plan(2, ["1"])
    s.aggregate(2, {})  # client 1 was sent its teacher but did not reply
    task = s.plan(3, ["0", "2"])["0"]
    assert task.type == "kd_train" and task.models["teacher"] is teacher
    assert task.config["kd_lambda"] == pytest.approx(0.2)
    assert "1" not in s.teachers


@pytest.mark.parametrize("name", ["pfedclub", "pfedhr"])
def test_the_kd_train_task_carries_the_kl_direction_option(name):
    default = make(name).plan(0, ["0"])["0"]
    literal = make(name, kd_direction="student_teacher").plan(0, ["0"])["0"]
    assert default.config["kd_direction"] == "teacher_student"
    assert literal.config["kd_direction"] == "student_teacher"
    assert TrainTask.from_config(literal.config).kd_direction == "student_teacher"
    with pytest.raises(ConfigError, match="kd_direction must be one of teacher_student, student_teacher"):
        make(name, kd_direction="reverse")


def test_pfedclub_plus_teachers_respect_eta_and_profile():
    s = make("pfedclub+", eta=0.0)
    s.aggregate(0, uploads(0, list(MODELS)))
    for cid, teacher in s.teachers.items():
        assert teacher.spec.params <= spec(cid).params


def test_negative_eta_without_any_candidate_falls_back_to_no_teacher(caplog):
    s = make("pfedclub+", eta=-0.9)
    with caplog.at_level(logging.WARNING):
        s.aggregate(0, uploads(0, ["0", "1"]))
    assert s.teachers == {}
    assert "no teacher" in caplog.text
    record = s.record(0, "0")
    assert record["teacher_fallback"] is True and record["teacher_params"] is None


@pytest.mark.parametrize(
    "ablation, index", [("max", "raw"), ("min", "raw"), ("noc", "raw"), ("nbc", "raw"), ("none", "relative")]
)
def test_ablations_and_index_modes_run(ablation, index):
    s = make("pfedclub", ablation=ablation, cmsr_index=index)
    s.aggregate(0, uploads(0, ["0", "1", "3"]))
    assert set(s.teachers) == {"0", "1", "3"}


def test_unknown_ablation_and_missing_public_data_are_refused():
    with pytest.raises(ConfigError, match="ablation"):
        make("pfedclub", ablation="bogus")
    with pytest.raises(ConfigError, match="index"):
        make("pfedclub", cmsr_index="bogus")
    with pytest.raises(ConfigError, match="has no option.*'eta'"):
        make("pfedclub", eta=0.1)  # only pFedClub+ has the size bound
    s = create_strategy("pfedclub", CONFIG)
    with pytest.raises(StrategyError, match="public samples"):
        s.setup({"0": ClientInfo("0", spec("0"), "rpi-4", 20, 5)})


# A hand-built pool of two three-block linear models on (1,3,3) inputs, block i of both in group i:
# a: 9·2+2 = 20, 2·40+40 = 120, 40·10+10 = 410 params (550); b: 9·40+40 = 400, 40·2+2 = 82, 2·10+10 = 30 (512).
TINY = PublicData(torch.randn(16, 1, 3, 3, generator=torch.Generator().manual_seed(1)), torch.arange(16) % 10)


def tiny(name, widths):
    blocks = [("b0", [L("flatten"), L("linear", {"out_features": widths[0]})])]
    blocks += [(f"b{i}", [L("linear", {"out_features": w})]) for i, w in enumerate(widths[1:], 1)]
    return make_spec(name, (1, 3, 3), widths[-1], blocks).with_origin(name)


TINY_SPECS = {"a": tiny("a", [2, 40, 10]), "b": tiny("b", [40, 2, 10])}


def tiny_strategy(name, **options):
    s = create_strategy(
        name, CONFIG, TINY, {"finetune_epochs": 1, "finetune_min_steps": 0, "max_candidates": 0} | options
    )
    s.setup({cid: ClientInfo(cid, sp, "jetson-orin-nano", 20, 5) for cid, sp in TINY_SPECS.items()})
    return s


def tiny_pool(similarity=None):
    torch.manual_seed(0)
    uploads = {cid: Weights(sp, build(sp).state_dict()) for cid, sp in TINY_SPECS.items()}
    labels = torch.tensor([0, 1, 2, 0, 1, 2])  # blocks a0 a1 a2 b0 b1 b2
    return Pool(uploads, torch.eye(6) * 2 if similarity is None else similarity, labels)


def rounds_with_anchor(s, cid, pool, anchor):
    return [rnd for rnd in range(40) if s.search(rnd, cid, pool).anchor == anchor]


def test_pfedclub_plus_bounds_whole_stitched_models_not_blocks():
    # Client a, η = 0: with anchor b0 (400 params in place of a0's 20) the whole model b = 512 <= 550 is kept;
    # a per-block budget would have refused b0 as an anchor at all.
    pool = tiny_pool()
    s = tiny_strategy("pfedclub+", eta=0.0)
    rnd = rounds_with_anchor(s, "a", pool, ("b", 0))[0]
    found = s.search(rnd, "a", pool)
    assert (("b", 0), ("b", 1), ("b", 2)) in found.candidates
    for keys in found.candidates:
        spec, _ = candidate_spec("c", [pool.blocks[k] for k in keys], (1, 3, 3), 10)
        assert spec.params <= TINY_SPECS["a"].params
    assert found.total == 4 and len(found.candidates) == 1  # the other three are pruned as prefixes already too big


def test_pfedclub_plus_takes_the_same_random_anchor_as_pfedclub():
    pool = tiny_pool()
    club, plus = tiny_strategy("pfedclub"), tiny_strategy("pfedclub+", eta=0.0)
    anchors = [club.search(rnd, "a", pool).anchor for rnd in range(20)]
    assert anchors == [plus.search(rnd, "a", pool).anchor for rnd in range(20)]
    assert set(anchors) == {("a", 0), ("b", 0)}  # Step 1 stays the paper's random pick from the whole group


def test_every_candidate_is_built_and_the_counts_are_recorded():
    s = make("pfedclub", max_candidates=0)
    s.aggregate(0, uploads(0, ["0", "1", "3"]))
    for cid in ("0", "1", "3"):
        row = s.record(0, cid)
        assert row["candidates"] == row["candidates_total"] >= 1 and row["candidates_rejected"] == 0
        assert 1 <= row["groups"] <= row["groups_after_kind_split"]
        assert row["anchor"].count("@") == 1
    capped = make("pfedclub", max_candidates=1)
    capped.aggregate(0, uploads(0, ["0", "1", "3"]))
    assert all(capped.record(0, cid)["candidates"] == 1 for cid in ("0", "1", "3"))


def test_a_teacher_identical_to_the_clients_model_is_counted_and_can_be_excluded():
    pool = tiny_pool()
    s = tiny_strategy("pfedclub")
    rnd = rounds_with_anchor(s, "a", pool, ("a", 0))[0]
    own = (("a", 0), ("a", 1), ("a", 2))
    assert own in s.search(rnd, "a", pool).candidates
    teacher, info = s.teacher_for(rnd, "a", pool)
    assert info["teacher_is_self"] is True and info["match_score"] == pytest.approx(1.0)
    assert teacher.spec.blocks == pool.uploads["a"].spec.blocks
    excluding = tiny_strategy("pfedclub", exclude_self=True)
    assert own not in excluding.search(rnd, "a", pool).candidates
    _, info = excluding.teacher_for(rnd, "a", pool)
    assert info["teacher_is_self"] is False


def test_exclude_self_never_returns_the_clients_own_model_even_when_it_is_the_only_candidate():
    pool = tiny_pool()
    pool.groups = {key: i for i, key in enumerate(pool.blocks)}  # every block alone in its group
    own = (("a", 0), ("a", 1), ("a", 2))
    assert tiny_strategy("pfedclub").search(0, "a", pool).candidates == [own]
    s = tiny_strategy("pfedclub", exclude_self=True)
    assert s.search(0, "a", pool).candidates == []
    teacher, info = s.teacher_for(0, "a", pool)
    assert teacher is None and info["teacher_fallback"] is True and info["teacher_is_self"] is False


def test_every_row_records_the_kept_candidates_composition_and_the_summary_sums_it():
    s = make("pfedclub", max_candidates=3)
    s.aggregate(0, uploads(0, ["0", "1", "3"]))
    rows = {cid: s.record(0, cid) for cid in ("0", "1", "3")}
    for row in rows.values():
        assert 0 <= row["own_block_share"] <= 1
        assert sum(row["foreign_blocks"]) == row["candidates"] >= 1
    summary = s.summary()
    assert summary["foreign_blocks"] == {cid: row["foreign_blocks"] for cid, row in rows.items()}
    assert summary["own_block_share"] == {cid: row["own_block_share"] for cid, row in rows.items()}


@pytest.mark.parametrize("fold", [True, False])
def test_the_fast_candidate_path_chooses_what_plain_weights_would_within_float_rounding(fold):
    # Candidates run over the pool's frozen modules (BatchNorm folded, channels-last, built once per block) and the
    # client's logits come from the feature pass: the same scores, the same teacher and its weights, within rounding,
    # as assembling, fine-tuning and matching plain weights (what the server did before).
    # Without folding (fold_frozen=false) the module path is the plain one's arithmetic: bit for bit.
    s = make("pfedclub", max_candidates=4, finetune_min_steps=12, fold_frozen=fold)
    gen = torch.Generator().manual_seed(5)
    stats = {
        "running_mean": lambda v: torch.randn(v.shape, generator=gen),
        "running_var": lambda v: 0.5 + torch.rand(v.shape, generator=gen),
    }
    models = {}
    for cid, r in uploads(0, ["0", "1", "3"]).items():  # BatchNorm statistics that folding must get right
        w = r.models["local"]
        models[cid] = Weights(w.spec, {k: stats.get(k.rsplit(".", 1)[-1], lambda v: v)(v) for k, v in w.state.items()})
    pool, _ = s.pool(0, models)
    pool.fold = fold
    x = s.public.x
    tol = 1e-5 if fold else 0.0
    for cid in ("0", "1", "3"):
        own = pool.uploads[cid]
        found = s.search(0, cid, pool)
        rng = np.random.default_rng(derive_seed(CONFIG.seed, "stitch-init", 0, cid))
        built = [
            assemble(f"c{i}", [pool.blocks[k] for k in ks], *own_io(own), rng) for i, ks in enumerate(found.candidates)
        ]
        tuned = finetune_candidates(built, x, s.public.y, s.finetune_config("finetune", 0, cid))
        best, scores = best_match(public_logits([own], x)[0], public_logits([t.weights for t in tuned], x))
        teacher, info = s.teacher_for(0, cid, pool)
        assert info["match_score"] == pytest.approx(scores[best], abs=tol)
        assert info["finetune_loss"] == pytest.approx([t.loss for t in tuned], abs=10 * tol)
        assert teacher.spec.blocks == tuned[best].weights.spec.blocks
        for k, v in tuned[best].weights.state.items():
            assert torch.allclose(teacher.state[k], v, atol=tol, rtol=0), k


def test_lockstep_chooses_the_same_teachers_bit_for_bit_on_cnn_blocks():
    # Lockstep runs a frozen pool block once for all candidates holding it, one backward for all. The CNNs' blocks
    # give each sample the same bits at any batch size on CPU; some MobileNet depthwise and 1x1 convolutions at 28x28
    # do not (oneDNN picks another kernel for the larger batch: docs/deviations.md, docs/results.md).
    cids = ("0", "1", "2")
    teachers, records, largest = {}, {}, {}
    for lockstep in (False, True):
        s = make("pfedclub", max_candidates=6, finetune_min_steps=12, lockstep=lockstep)
        batches = []
        hook = torch.nn.modules.module.register_module_forward_hook(
            lambda m, args, out, seen=batches: seen.append(len(args[0])) if args and torch.is_tensor(args[0]) else None
        )
        try:
            s.aggregate(0, uploads(0, list(cids)))
        finally:
            hook.remove()
        teachers[lockstep], records[lockstep] = s.teachers, {cid: s.record(0, cid) for cid in cids}
        largest[lockstep] = max(batches)
    # one after another no module sees more than the public set at once; in lockstep candidates' inputs are joined
    assert largest[False] == len(PUBLIC.x) < largest[True]
    for cid in cids:
        plain, step = teachers[False][cid], teachers[True][cid]
        assert plain.spec.blocks == step.spec.blocks
        assert all(torch.equal(step.state[k], v) for k, v in plain.state.items())
        a, b = records[False][cid], records[True][cid]
        assert (a["match_score"], a["finetune_loss"]) == (b["match_score"], b["finetune_loss"])


def test_clients_on_parallel_workers_get_the_same_teachers_as_one_after_another():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as `fedge run`'s server: one intra-op thread, workers over clients
    try:
        teachers = []
        for workers in (1, 3):
            s = make("pfedclub", max_candidates=3, finetune_min_steps=6)
            s.workers = workers
            s.aggregate(0, uploads(0, ["0", "1", "3"]))
            teachers.append((s.teachers, {cid: s.record(0, cid)["finetune_loss"] for cid in ("0", "1", "3")}))
    finally:
        torch.set_num_threads(threads)
    (serial, serial_loss), (parallel, parallel_loss) = teachers
    assert serial_loss == parallel_loss and set(serial) == set(parallel) == {"0", "1", "3"}
    for cid, teacher in serial.items():
        assert teacher.spec == parallel[cid].spec
        assert all(torch.equal(v, parallel[cid].state[k]) for k, v in teacher.state.items())


def test_public_labels_outside_the_clients_classes_are_refused_before_any_stitch_trains():
    bad = PublicData(TINY.x, TINY.y + 10)  # the tiny models have 10 classes
    s = create_strategy("pfedclub", CONFIG, bad, {"finetune_epochs": 1, "finetune_min_steps": 0, "max_candidates": 0})
    s.setup({cid: ClientInfo(cid, sp, "jetson-orin-nano", 20, 5) for cid, sp in TINY_SPECS.items()})
    pool = tiny_pool()
    rnd = rounds_with_anchor(s, "a", pool, ("b", 0))[0]  # a candidate with stitches
    with pytest.raises(ValueError, match=r"public labels must lie in \[0, 10\)"):
        s.teacher_for(rnd, "a", pool)


def test_summary_reports_phi_with_and_without_fallback_rounds():
    s = make("pfedclub+", eta=0.0)
    s.history["0"] = [
        {"phi": 0.0, "teacher_params": 10, "candidates": 0, "teacher_fallback": True, "teacher_is_self": True},
        {"phi": -0.5, "teacher_params": 5, "candidates": 3, "candidates_total": 9, "teacher_fallback": False},
    ]
    summary = s.summary()
    assert summary["phi"]["0"] == pytest.approx(-0.25) and summary["phi_without_fallback"]["0"] == pytest.approx(-0.5)
    assert summary["fallback_rounds"]["0"] == 1 and summary["teacher_is_self_rounds"]["0"] == 1
    assert summary["candidates_generated_per_client"]["0"] == 9


@pytest.mark.parametrize("name", ["pfedclub", "pfedhr"])
def test_an_upload_with_huge_finite_weights_is_left_out_and_the_others_get_teachers(name):
    # Finite weights pass the coordinator's checks, but ×1e30 gives Inf/NaN block features: Eq. (1) would be
    # undefined for the whole pool and the aggregation would raise, stopping the run for every client.
    s = make(name)
    results = uploads(0, ["0", "1", "3"])
    w = results["1"].models["local"]
    huge = {k: v * 1e30 if v.is_floating_point() else v for k, v in w.state.items()}
    results["1"] = Result("1", 0, "kd_train", 20, {}, {"local": Weights(w.spec, huge)})
    s.aggregate(0, results)
    assert "not finite" in s.record(0, "1")["teacher_error"] and "1" not in s.teachers
    assert {"0", "3"} <= set(s.teachers) or name == "pfedhr"  # pFedHR's Alg. 1 may keep no candidate
    assert all("teacher_error" not in s.record(0, cid) for cid in ("0", "3"))
