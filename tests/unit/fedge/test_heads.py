"""Models cut as extractor + head: which zoo models have a head, the head's own spec and tensors, and
extractor-then-head being the whole model."""

import pytest
import torch

from fedge.model.layers import LayerSpec as L
from fedge.model.spec import build, make_spec
from fedge.model.weights import load_module
from fedge.model.zoo import FEDGH_CNNS, create
from methods.dcpfl.heads import HeadError, extract, head_spec, head_state, put_head, representation_size

pytestmark = pytest.mark.timeout(60)
SHAPE = (1, 28, 28)


def model(name, seed=0):
    torch.manual_seed(seed)
    return build(create(name, SHAPE, 10))


def test_the_head_of_cnn1_is_its_one_linear_fc2():
    spec = create("cnn1", SHAPE, 10)
    head = head_spec(spec)
    assert head.input_shape == (128,) and head.num_classes == 10 and len(head.blocks) == 1
    assert [layer.type for layer in head.blocks[0].layers] == ["linear"]
    assert head.blocks[0].layers == spec.blocks[-1].layers and head.blocks[0].out_shape == (10,)
    assert representation_size(spec) == 128


def test_the_head_of_mobilenet_v2_is_dropout_and_linear():
    spec = create("mobilenet_v2", SHAPE, 10)
    head = head_spec(spec)
    assert [layer.type for layer in head.blocks[0].layers] == ["dropout", "linear"]
    assert head.input_shape == spec.blocks[-1].in_shape and len(head.input_shape) == 1


def test_mobilenet_v1_pools_a_map_in_its_last_block_and_has_no_head():
    with pytest.raises(
        HeadError, match=r"model 'mobilenet_v1' cannot be cut.*'classifier' takes a \[\d+, \d+, \d+\] map"
    ):
        head_spec(create("mobilenet_v1", SHAPE, 10))


@pytest.mark.parametrize("kinds", [["linear", "relu", "linear"], ["relu", "linear"], ["linear", "dropout"]])
def test_a_last_block_other_than_dropout_and_one_linear_is_no_head(kinds):
    args = {"linear": {"out_features": 3}, "relu": {}, "dropout": {"p": 0.5}}
    spec = make_spec("odd", (1, 4, 4), 3, [("flat", [L("flatten")]), ("fc", [L(k, args[k]) for k in kinds])])
    with pytest.raises(HeadError, match=rf"{kinds}, not one linear layer".replace("[", r"\[")):
        head_spec(spec)


def test_head_state_and_put_head_round_trip():
    a, b = model("cnn1", seed=0), model("cnn1", seed=1)
    spec = a.spec
    head = head_state(spec, a.state_dict())
    assert set(head) == {"blocks.0.0.weight", "blocks.0.0.bias"}
    assert load_module(head_spec(spec), head).state_dict().keys() == head.keys()  # named as the head's own model
    extractor = {k: v.clone() for k, v in b.state_dict().items() if not k.startswith("blocks.3.")}
    put_head(b, head)
    back = head_state(spec, b.state_dict())
    assert all(torch.equal(back[k], head[k]) for k in head)
    assert all(torch.equal(b.state_dict()[k], v) for k, v in extractor.items())  # the extractor untouched
    with torch.no_grad():
        a.blocks[-1][0].weight.add_(1.0)
    assert torch.equal(back["blocks.0.0.weight"], head["blocks.0.0.weight"])  # head_state copies


def test_put_head_refuses_tensors_of_another_head():
    other = head_state(create("fedgh_cnn1", SHAPE, 10), model("fedgh_cnn1").state_dict())
    with pytest.raises(HeadError, match="do not fit the last block of 'cnn1'"):
        put_head(model("cnn1"), other)
    with pytest.raises(HeadError):
        put_head(model("cnn1"), {"blocks.0.0.weight": torch.zeros(10, 128)})


@pytest.mark.parametrize("name", ["cnn1", "mobilenet_v2", "fedgh_cnn3"])
def test_extract_then_the_last_block_is_the_model(name):
    m = model(name).eval()
    x = torch.randn(5, *SHAPE, generator=torch.Generator().manual_seed(2))
    z = extract(m, x)
    assert z.shape == (5, representation_size(m.spec))
    assert torch.equal(m.blocks[-1](z), m(x))


def test_fedghs_five_cnns_share_one_head_and_cnn1_does_not():
    heads = [head_spec(create(name, SHAPE, 10).with_origin(str(i))) for i, name in enumerate(FEDGH_CNNS)]
    assert len(heads) == 5 and all(h == heads[0] for h in heads)
    assert heads[0].input_shape == (500,)
    assert head_spec(create("cnn1", SHAPE, 10)) != heads[0]
    assert head_spec(create("fedgh_cnn1", SHAPE, 100)) != heads[0]  # another number of classes
