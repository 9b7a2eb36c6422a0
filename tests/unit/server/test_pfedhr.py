"""pFedHR's server half: Alg. 1's candidates as they come, matched against a fine-tuned copy of each client model."""

import pytest
import torch
from torch.nn import functional as F

import methods.pfedhr.server
from fedge.config import ConfigError
from fedge.model.spec import build
from fedge.model.zoo import create
from fedge.wire.messages import ClientInfo, Result, Weights
from methods.pfedhr.candidates import block_operations, depth_order, pfedhr_candidates
from methods.reassembly.finetune import FinetuneConfig, finetune_model, match_score, public_logits
from server.strategy import PublicData, StrategyConfig, create_strategy

pytestmark = pytest.mark.timeout(120)
MODELS = {str(i): "cnn1" for i in range(6)} | {"6": "cnn2"}
PUBLIC = PublicData(torch.randn(32, 1, 8, 8, generator=torch.Generator().manual_seed(0)), torch.arange(32) % 10)
CONFIG = StrategyConfig(local_epochs=1, batch_size=8, lr=1e-3, seed=0)


def spec(cid):
    return create(MODELS[cid], (1, 8, 8), 10).with_origin(cid)


def make(**options):
    s = create_strategy("pfedhr", CONFIG, PUBLIC, {"finetune_epochs": 1, "finetune_min_steps": 0} | options)
    s.setup({cid: ClientInfo(cid, spec(cid), "rpi-4", 20, 5) for cid in MODELS})
    return s


def uploads(cids):
    out = {}
    for cid in cids:
        torch.manual_seed(int(cid))
        out[cid] = Result(cid, 0, "kd_train", 20, {}, {"local": Weights(spec(cid), build(spec(cid)).state_dict())})
    return out


def snapshot(w):
    return {k: v.clone() for k, v in w.state.items()}


def test_match_scores_are_against_a_finetuned_copy_and_the_upload_stays_bit_identical(monkeypatch):
    copies = {}

    def spy(model, *args, **kwargs):
        copies[model.spec.blocks[0].origin.client] = (model, out := finetune_model(model, *args, **kwargs))
        return out

    monkeypatch.setattr(methods.pfedhr.server, "finetune_model", spy)
    s, results = make(), uploads(list(MODELS))
    before = {cid: snapshot(r.models["local"]) for cid, r in results.items()}
    s.aggregate(0, results)
    assert set(copies) == set(MODELS) == set(s.teachers)
    for cid, (given, copy) in copies.items():
        upload = results[cid].models["local"]
        assert given is upload
        assert all(torch.equal(upload.state[k], v) for k, v in before[cid].items())
        teacher, record = s.teachers[cid], s.record(0, cid)
        assert teacher.spec.name.startswith("pfedhr-r0-")  # the client gets a candidate, never the copy
        copy_logits, upload_logits, teacher_logits = public_logits([copy, upload, teacher], PUBLIC.x)
        assert record["match_score"] == pytest.approx(match_score(copy_logits, teacher_logits), abs=1e-6)
        assert record["match_score"] != pytest.approx(match_score(upload_logits, teacher_logits), abs=1e-4)


def test_m_is_what_alg_1_finds_and_records_say_how_many_blocks_were_scanned():
    s, results = make(), uploads(list(MODELS))
    pool, _ = s.pool(0, {cid: r.models["local"] for cid, r in results.items()})
    search = pfedhr_candidates(depth_order(pool.groups), block_operations(pool.blocks.values()))
    assert len(search.candidates) > 4  # more than the old fixed M = 4
    s.aggregate(0, results)
    record = s.record(0, "0")
    assert record["candidates"] == len(search.candidates)
    assert record["candidates_generated"] == len(pool.blocks) == 6 * 4 + len(spec("6").blocks)


@pytest.mark.parametrize("finetune", ["all", "stitches"])
def test_candidates_finetune_every_parameter_as_the_paper_or_only_their_stitches(finetune):
    # §3.1.3 and the authors' code update the stitched models' parameters; "stitches" is pFedClub's Eq. (2) rule.
    s, results = make(pfedhr_finetune=finetune), uploads(list(MODELS))
    s.aggregate(0, results)
    teacher, record = s.teachers["0"], s.record(0, "0")
    assert record["finetune_steps"] >= 1 and len(record["finetune_loss"]) == record["candidates"]
    moved = []
    for i, block in enumerate(teacher.spec.blocks):
        if block.origin.model == "stitch":
            continue
        upload = results[block.origin.client].models["local"].state
        keys = [k for k in teacher.state if k.startswith(f"blocks.{i}.") and teacher.state[k].is_floating_point()]
        moved += [
            not torch.equal(teacher.state[k], upload[f"blocks.{block.origin.block}.{k.split('.', 2)[2]}"]) for k in keys
        ]
    assert moved and (all(moved) if finetune == "all" else not any(moved))
    with pytest.raises(ConfigError, match="pfedhr_finetune"):
        make(pfedhr_finetune="blocks")


def test_no_candidate_passing_r4_gives_no_teachers_and_says_so():
    s = make(clusters=12)  # 12 groups over blocks of indices 0-3 (cnn1) and 0-4 (cnn2): R4 can never hold
    s.aggregate(0, uploads(["0", "1", "6"]))
    assert s.teachers == {}
    record = s.record(0, "0")
    assert record["candidates"] == 0 and record["candidates_generated"] == 13
    assert record["teacher_params"] is None


def test_unlabeled_public_data_finetune_the_copy_without_labels(monkeypatch):
    seen = []

    def spy(model, x, y, cfg, device):
        seen.append((y, cfg.labeled))
        return finetune_model(model, x, y, cfg, device)

    monkeypatch.setattr(methods.pfedhr.server, "finetune_model", spy)
    s = make(public="unlabeled")
    s.aggregate(0, uploads(list(MODELS)))
    assert seen == [(None, False)] * len(MODELS) and set(s.teachers) == set(MODELS)


# --- finetune_model (methods/reassembly/finetune.py), the whole-model fine-tuning pFedHR uses ---------------


@pytest.mark.parametrize("labeled", [True, False])
def test_finetune_model_trains_every_parameter_of_a_copy_deterministically(labeled):
    model = uploads(["6"])["6"].models["local"]
    before, rng_before = snapshot(model), torch.get_rng_state()
    cfg = FinetuneConfig(epochs=2, batch_size=8, labeled=labeled, seed=3)
    y = PUBLIC.y if labeled else None
    a, b = (finetune_model(model, PUBLIC.x, y, cfg) for _ in range(2))
    assert all(torch.equal(model.state[k], v) for k, v in before.items())
    assert torch.equal(torch.get_rng_state(), rng_before)  # dropout's global draws were forked and restored
    assert a.spec == model.spec and all(torch.equal(a.state[k], b.state[k]) for k in a.state)
    trained = [k for k in a.state if k.endswith(("weight", "bias"))]
    assert trained and all(not torch.equal(a.state[k], model.state[k]) for k in trained)


def test_finetune_model_fits_labeled_public_data():
    model = uploads(["0"])["0"].models["local"]

    def loss(w):
        return float(F.cross_entropy(public_logits([w], PUBLIC.x)[0], PUBLIC.y))

    tuned = finetune_model(model, PUBLIC.x, PUBLIC.y, FinetuneConfig(epochs=30, batch_size=8, seed=0))
    assert loss(tuned) < 0.5 * loss(model)


def test_finetune_model_refuses_bad_public_data():
    model = uploads(["0"])["0"].models["local"]
    with pytest.raises(ValueError, match="public data"):
        finetune_model(model, torch.zeros(4, 3, 8, 8), PUBLIC.y[:4])
    with pytest.raises(ValueError, match="labeled"):
        finetune_model(model, PUBLIC.x, None)
