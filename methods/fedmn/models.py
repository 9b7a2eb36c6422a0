"""FedMN's models, which both its halves and anyone building a FedMN spec need: the `modular` layer type
(methods/fedmn/modular.py, registered on import) and the zoo's family of modular networks fedmn_<units>_<encoder>.
fedge.plugins loads this module when a layer type or a model family is first looked up."""

from __future__ import annotations

import re

from fedge.model.layers import LayerSpec as L
from fedge.model.layers import SpecError
from fedge.model.spec import ModelSpec, make_spec
from fedge.model.zoo import FAMILIES, FLAT, MODELS, RELU, Family, ZooError, create
from methods.fedmn import modular  # noqa: F401  (registers the `modular` layer type)

# FedMN's modular networks (Wang et al. 2022, methods/fedmn/modular.py), named fedmn_<units>_<encoder>: e.g.
# fedmn_2x2x2_mobilenet_v2 (the paper's CIFAR-10 pool, Table I), fedmn_3x3x3_cnn1, fedmn_1x4x3_fc (§IV-D's MLP pool).
# The encoder is a zoo model without its last block (its representation), or "fc": one linear layer of the hidden
# width. The MLP blocks are Linear(hidden) → ReLU → Dropout(0.5) (the authors' MLP_block; their modular_hdims
# [512, 256] give 256 at the paper preset), the last layer's blocks give the logits. The routing hypernetwork's φx is
# the encoder's architecture with a linear map to 128 (for "fc": one linear layer, §IV-D), φy maps the one-hot
# label to 64 (the authors' policy_hdim_x / policy_hdim_y).
FEDMN_NAME = re.compile(r"fedmn_(\d+(?:x\d+)+)_(\w+)")
FEDMN_FC = "fc"
FEDMN_HIDDEN = {"cpu": 128, "paper": 256}
FEDMN_DROPOUT = 0.5
FEDMN_ROUTER_X, FEDMN_ROUTER_Y = 128, 64


def fedmn_network(
    name: str, units: str, encoder: str, input_shape: tuple[int, int, int], num_classes: int, widths: str
) -> ModelSpec:
    """The modular network `name` (fedmn_<units>_<encoder>); ZooError for an unknown encoder or one whose last block
    does not take a vector."""
    hidden = FEDMN_HIDDEN[widths]
    if encoder == FEDMN_FC:
        layers = [FLAT, L("linear", {"out_features": hidden}), RELU]
        phi_x = [FLAT, L("linear", {"out_features": FEDMN_ROUTER_X})]
    else:
        if encoder not in MODELS:
            raise ZooError(f"unknown FedMN encoder {encoder!r} in {name!r}; use fc or one of {', '.join(MODELS)}")
        full = create(encoder, input_shape, num_classes, widths)
        if len(full.blocks[-1].in_shape) != 1:
            raise ZooError(f"{encoder!r} cannot be a FedMN encoder: its last block takes a map, not a vector")
        layers = [layer for block in full.blocks[:-1] for layer in block.layers]
        phi_x = [*layers, L("linear", {"out_features": FEDMN_ROUTER_X})]
    counts = [int(n) for n in units.split("x")]
    args = {
        "units": counts,
        "encoder": [layer.to_dict() for layer in layers],
        "widths": [hidden] * (len(counts) - 2) + [num_classes],
        "dropout": FEDMN_DROPOUT,
        "router_x": [layer.to_dict() for layer in phi_x],
        "router_y": FEDMN_ROUTER_Y,
    }
    try:
        return make_spec(name, input_shape, num_classes, [("modular", [L("modular", args)])])
    except SpecError as e:
        raise ZooError(f"{name!r}: {e}") from None


FAMILIES.add(
    "fedmn",
    Family(
        FEDMN_NAME,
        lambda match, shape, classes, widths: fedmn_network(match[0], match[1], match[2], shape, classes, widths),
        lambda match: match[2] in MODELS or match[2] == FEDMN_FC,
    ),
)
