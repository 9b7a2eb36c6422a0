"""What the ExecuTorch export tests share: zoo lists, seeded weights and teacher logits, a model with every pool."""

import torch

from fedge.model.layers import LayerSpec as L
from fedge.model.spec import build, make_spec
from fedge.model.zoo import MODELS

SHAPE = (1, 28, 28)
BN_MODELS = ["cnn4", "mobilenet_v1", "mobilenet_v2", "mobilenet_v3"]
TRAINABLE = [m for m in MODELS if m not in BN_MODELS]  # BN-free: their float32 programs match eager float64 directly


def weights(spec, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in build(spec).state_dict().items()}


def teacher_logits(n: int, seed: int = 1) -> torch.Tensor:
    return 3 * torch.randn(n, 10, generator=torch.Generator().manual_seed(seed))


POOLS = make_spec(
    "pools",
    (1, 9, 9),
    10,
    [
        (
            "c1",
            [
                L("conv2d", {"out_channels": 4, "kernel_size": 3, "padding": 1}),
                L("relu"),
                L("maxpool", {"kernel_size": 2}),
            ],
        ),  # 9 → 4 (odd side is cropped)
        (
            "c2",
            [
                L("conv2d", {"out_channels": 6, "kernel_size": 3, "padding": 1}),
                L("relu"),
                L("avgpool", {"kernel_size": 2}),
                L("adaptive_avgpool"),
                L("flatten"),
                L("dropout", {"p": 0.5}),
                L("linear", {"out_features": 10}),
            ],
        ),
    ],
)
