"""ModelSpec: a model as plain data (blocks of registered layers with shapes and origins), and build()."""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache
from typing import Any, Sequence

import torch
from torch import nn

from fedge.constants import SHAPES_CACHE_SIZE, SPEC_SCHEMA_VERSION
from fedge.model.layers import LayerSpec, Shape, SpecError, layer_type

Device = torch.device | str


@dataclass(frozen=True)
class Origin:
    """Where a block came from: the model family, the client that uploaded it, its index there."""

    model: str
    client: str | None = None
    block: int = 0


@dataclass(frozen=True)
class BlockSpec:
    """An ordered list of layers with the per-sample shape it takes and gives."""

    name: str
    layers: tuple[LayerSpec, ...]
    in_shape: Shape
    out_shape: Shape
    origin: Origin

    @property
    def params(self) -> int:
        return _layers_total(self.layers, self.in_shape, "params")

    @property
    def macs(self) -> int:
        return _layers_total(self.layers, self.in_shape, "macs")


def _layers_out(layers: Sequence[LayerSpec], shape: Shape) -> Shape:
    for layer in layers:
        shape = tuple(layer_type(layer.type).out_shape(layer.args, shape))
    return shape


def _layers_total(layers: Sequence[LayerSpec], shape: Shape, what: str) -> int:
    total = 0
    for layer in layers:
        kind = layer_type(layer.type)
        total += getattr(kind, what)(layer.args, shape)
        shape = tuple(kind.out_shape(layer.args, shape))
    return total


def make_block(name: str, layers: Sequence[LayerSpec], in_shape: Shape, origin: Origin) -> BlockSpec:
    """A block whose output shape is computed from its layers; a layer that does not fit raises SpecError."""
    try:
        out = _layers_out(layers, tuple(in_shape))
    except (SpecError, KeyError, TypeError) as e:
        raise SpecError(f"block {name!r}: {e}") from None
    return BlockSpec(name, tuple(layers), tuple(in_shape), out, origin)


@dataclass(frozen=True)
class ModelSpec:
    """A whole model as data: input shape, classes, blocks. Construct via make_spec or from_dict."""

    name: str
    input_shape: Shape
    num_classes: int
    blocks: tuple[BlockSpec, ...]

    def __post_init__(self) -> None:
        validate(self)

    @cached_property
    def params(self) -> int:
        """Trainable parameters plus BN affine parameters, counted from the spec alone."""
        return sum(b.params for b in self.blocks)

    @cached_property
    def macs(self) -> int:
        """Forward multiply-accumulates per sample (conv and linear layers), from the spec alone."""
        return sum(b.macs for b in self.blocks)

    @cached_property
    def activations(self) -> int:
        """Elements per sample a training step keeps for backward: the input, then every layer's output once
        (LayerType.activation_elements), from the spec alone."""
        total, shape = math.prod(self.input_shape), tuple(self.input_shape)
        for b in self.blocks:
            for layer in b.layers:
                kind = layer_type(layer.type)
                total += kind.activation_elements(layer.args, shape)
                shape = tuple(kind.out_shape(layer.args, shape))
        return total

    def with_origin(self, client: str | None) -> ModelSpec:
        """The same spec with every block's origin naming `client` (what a client does at registration)."""
        blocks = tuple(replace(b, origin=replace(b.origin, client=client)) for b in self.blocks)
        return replace(self, blocks=blocks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SPEC_SCHEMA_VERSION,
            "name": self.name,
            "input_shape": list(self.input_shape),
            "num_classes": self.num_classes,
            "blocks": [
                {
                    "name": b.name,
                    "layers": [ly.to_dict() for ly in b.layers],
                    "in_shape": list(b.in_shape),
                    "out_shape": list(b.out_shape),
                    "origin": {"model": b.origin.model, "client": b.origin.client, "block": b.origin.block},
                }
                for b in self.blocks
            ],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSpec:
        """Parse and validate; anything malformed raises SpecError saying which field or block."""
        if not isinstance(d, dict):
            raise SpecError(f"a model spec must be a JSON object, got {type(d).__name__}")
        if d.get("schema") != SPEC_SCHEMA_VERSION:
            raise SpecError(f"unsupported spec schema {d.get('schema')!r}; this fedge reads {SPEC_SCHEMA_VERSION}")
        try:
            blocks = tuple(
                BlockSpec(
                    str(b["name"]),
                    tuple(LayerSpec(str(ly["type"]), dict(ly.get("args", {}))) for ly in b["layers"]),
                    tuple(int(v) for v in b["in_shape"]),
                    tuple(int(v) for v in b["out_shape"]),
                    Origin(str(b["origin"]["model"]), b["origin"]["client"], int(b["origin"]["block"])),
                )
                for b in d["blocks"]
            )
            return cls(str(d["name"]), tuple(int(v) for v in d["input_shape"]), int(d["num_classes"]), blocks)
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, SpecError):
                raise
            raise SpecError(f"malformed model spec: missing or invalid field {e}") from None

    @classmethod
    def from_json(cls, text: str) -> ModelSpec:
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as e:
            raise SpecError(f"model spec is not valid JSON: {e}") from None


def validate(spec: ModelSpec) -> None:
    """Check that shapes chain from the input through every block to (num_classes,).

    Raises SpecError naming the first offending block and the mismatch.
    """
    if not spec.blocks:
        raise SpecError(f"model {spec.name!r} has no blocks")
    shape = tuple(spec.input_shape)
    for i, b in enumerate(spec.blocks):
        where = f"model {spec.name!r}, block {i} ({b.name!r})"
        if tuple(b.in_shape) != shape:
            raise SpecError(
                f"{where}: declared input shape {list(b.in_shape)} but the previous block gives {list(shape)}"
            )
        try:
            shape = _layers_out(b.layers, shape)
        except (SpecError, KeyError, TypeError) as e:
            raise SpecError(f"{where}: {e}") from None
        if shape != tuple(b.out_shape):
            raise SpecError(f"{where}: declared output shape {list(b.out_shape)} but its layers give {list(shape)}")
    if shape != (spec.num_classes,):
        raise SpecError(f"model {spec.name!r}: final output shape {list(shape)} != ({spec.num_classes},) classes")


def make_spec(
    name: str, input_shape: Shape, num_classes: int, blocks: Sequence[tuple[str, Sequence[LayerSpec]]]
) -> ModelSpec:
    """Chain named layer lists into a ModelSpec, computing every block's shapes; origins name `name`."""
    built, shape = [], tuple(input_shape)
    for i, (bname, layers) in enumerate(blocks):
        block = make_block(bname, layers, shape, Origin(name, None, i))
        built.append(block)
        shape = block.out_shape
    return ModelSpec(name, tuple(input_shape), num_classes, tuple(built))


def build_block(block: BlockSpec) -> nn.Sequential:
    """The module of one block: its layers in order, built for the shapes they see (on torch's current device)."""
    layers, shape = [], block.in_shape
    for ly in block.layers:
        kind = layer_type(ly.type)
        layers.append(kind.build(ly.args, shape))
        shape = tuple(kind.out_shape(ly.args, shape))
    return nn.Sequential(*layers)


class SpecModel(nn.Module):
    """The nn.Module built from a ModelSpec; parameters are named `blocks.<i>.<j>.*`."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.blocks = nn.ModuleList(build_block(b) for b in spec.blocks)

    def run_block(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Run block i alone on a batch of its inputs."""
        return self.blocks[i](x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def build(spec: ModelSpec, device: Device | None = None) -> SpecModel:
    """Build the module for a spec (on `device`; 'meta' builds shapes without memory)."""
    with torch.device(device or "cpu"):
        return SpecModel(spec)


_shapes: OrderedDict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]] = OrderedDict()
_shapes_lock = threading.Lock()


def tensor_shapes(spec: ModelSpec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name → (shape, dtype) of every tensor in the model's state dict, without allocating weights.

    The model is built on "meta" once per distinct spec (its JSON): the last SHAPES_CACHE_SIZE are remembered,
    since every received model is checked against its spec. A spec whose layers cannot be built raises what
    building raises, every time."""
    key = spec.to_json()
    with _shapes_lock:
        shapes = _shapes.get(key)
        if shapes is not None:
            _shapes.move_to_end(key)
            return dict(shapes)
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in build(spec, "meta").state_dict().items()}
    with _shapes_lock:
        _shapes[key] = shapes
        while len(_shapes) > SHAPES_CACHE_SIZE:
            _shapes.popitem(last=False)
    return dict(shapes)


@lru_cache(maxsize=SHAPES_CACHE_SIZE)
def _parameter_names(spec_json: str) -> frozenset[str]:
    return frozenset(n for n, _ in build(ModelSpec.from_json(spec_json), "meta").named_parameters())


def parameter_names(spec: ModelSpec) -> frozenset[str]:
    """The names of the model's learned parameters (what an optimizer trains); the rest of its state dict are
    buffers (BatchNorm's running statistics and counter, a FedMN routing). Built on "meta", remembered per
    architecture (the spec without its origin: one entry for a fleet of one model)."""
    return _parameter_names(spec.with_origin(None).to_json())
