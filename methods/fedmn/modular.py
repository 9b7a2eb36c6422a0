"""FedMN's modular network (Wang et al., ICDM 2022, §II-A, II-D, II-E) as one registered layer type, `modular`, and
the routes through it: what the client trains and evaluates, what the server aggregates block by block, and what
export traces all read from here.

The pool has L layers of blocks: n_1 encoders (any extractor of the zoo, Eq. 1), then layers of MLP blocks
(linear, ReLU, dropout), the last layer's blocks giving the class logits. A route V ∈ {0,1}^E switches each of the
E = Σ_{l=1}^{L-1} n_l n_{l+1} + n_L connection paths on or off (§II-A): the paths from every block of layer l-1 to
every block of layer l, then one path from each block of layer L to the output. Path order: for l = 2..L, for each
block j of layer l, for each block k of layer l-1 (so row j of C^(l) ∈ {0,1}^{n_l × n_{l-1}} is contiguous), then
the n_L output paths.

A block's input is the mean of the outputs of its connected predecessors (Eq. 11), 0 when none is connected; the
logits are the same mean over the output paths. Where Eq. 11 leaves it open, a block with no input is *inactive*
(§II-E) and gives no output: a path from it carries nothing (Eq. 11 read literally would pass block(0), a function
of its bias, downstream while §II-E never uploads it). A block is *used* when it lies on a path from the input to
the output; only used blocks are computed in evaluation.

What travels (§II-E): a client downloads the router and the blocks its route *reaches* (the paper's active blocks,
whose input is not 0: every encoder, and the blocks connected to them), since training computes them all: a path that
is off still needs its predecessor's output for its straight-through gradient. It uploads the router and the blocks
it *used*, the only ones that trained (docs/deviations.md: uploading a reachable block whose output is discarded would
send back what it downloaded and pull the average toward it).

The layer also holds the routing hypernetwork (§II-D: φx, φy, h of Eqs. 8-10), which forward never runs, and the
buffer `routing`: the decision forward uses outside training (the client's most likely route), so evaluation and
ONNX export use the client's routing unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from fedge.model.layers import (
    LayerSpec,
    LayerType,
    Shape,
    SpecError,
    _build_seq,
    _chain_out,
    _sum,
    _sum_activations,
    register_layer,
)

if TYPE_CHECKING:
    from fedge.model.spec import ModelSpec, SpecModel

LAYER = "modular"
ROUTER = "router"  # the name of the always-exchanged part (the routing hypernetwork)
# Named tensors of FedMN's tasks and replies (bool, one per path): the route a client trains this round (the task
# carries it, the reply repeats it), its sampled route for the next round, and its most likely route (evaluation).
ROUTE, NEXT_ROUTE, ROUTING = "route", "next_route", "routing"


@dataclass(frozen=True)
class Layout:
    """The shape of a pool: blocks per layer (n_1 encoders, ..., n_L output blocks) and the path indexing."""

    units: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.units) < 2 or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.units):
            raise SpecError(f"modular units must be at least two layer sizes >= 1 (e.g. [2, 2, 2]), got {self.units}")

    @property
    def layers(self) -> int:
        return len(self.units)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Index of the first path into each layer l = 2..L (as offsets[l - 2]), then of the first output path."""
        out, at = [], 0
        for prev, n in zip(self.units, self.units[1:]):
            out.append(at)
            at += prev * n
        return (*out, at)

    @property
    def paths(self) -> int:
        """E = Σ n_l n_{l+1} + n_L (§II-A)."""
        return self.offsets[-1] + self.units[-1]

    def path(self, layer: int, j: int, k: int) -> int:
        """The index of the path from block k of layer `layer` - 1 to block j of layer `layer` (layers from 1)."""
        return self.offsets[layer - 2] + j * self.units[layer - 2] + k

    def output_path(self, j: int) -> int:
        """The index of the path from block j of layer L to the output."""
        return self.offsets[-1] + j

    def blocks(self) -> list[tuple[int, int]]:
        """Every block as (layer, index), layers counted from 1 (the encoders)."""
        return [(layer, j) for layer, n in enumerate(self.units, start=1) for j in range(n)]


Route = Sequence[bool]


def reachable(layout: Layout, route: Route) -> set[tuple[int, int]]:
    """The blocks whose input is not 0 (Eq. 11): every encoder, then those with a path on from a reachable block."""
    out = {(1, j) for j in range(layout.units[0])}
    for layer in range(2, layout.layers + 1):
        for j in range(layout.units[layer - 1]):
            if any(route[layout.path(layer, j, k)] and (layer - 1, k) in out for k in range(layout.units[layer - 2])):
                out.add((layer, j))
    return out


def used_blocks(layout: Layout, route: Route) -> set[tuple[int, int]]:
    """The blocks on some path from the input to the output: reachable, and reaching the output."""
    reach = reachable(layout, route)
    last = layout.layers
    feeds = {(last, j) for j in range(layout.units[-1]) if route[layout.output_path(j)]}
    for layer in range(last - 1, 0, -1):
        for k in range(layout.units[layer - 1]):
            if any(route[layout.path(layer + 1, j, k)] and (layer + 1, j) in feeds for j in range(layout.units[layer])):
                feeds.add((layer, k))
    return reach & feeds


def has_path(layout: Layout, route: Route) -> bool:
    """Whether the route connects the input to the output at all."""
    return bool(used_blocks(layout, route))


def best_path(layout: Layout, logits: torch.Tensor) -> list[int]:
    """The paths of the most likely complete chain encoder → ... → output under independent decisions with
    P(on) = σ(logits) (Eq. 3): the chain maximising Σ log σ over its paths (a Viterbi pass over the layers)."""
    logp = F.logsigmoid(logits.detach().double()).tolist()
    score = [0.0] * layout.units[0]  # best log-probability of a chain ending at each block of the current layer
    back: list[list[int]] = []
    for layer in range(2, layout.layers + 1):
        prev, new, arg = layout.units[layer - 2], [], []
        for j in range(layout.units[layer - 1]):
            k = max(range(prev), key=lambda k: score[k] + logp[layout.path(layer, j, k)])
            new.append(score[k] + logp[layout.path(layer, j, k)])
            arg.append(k)
        score, back = new, [*back, arg]
    j = max(range(layout.units[-1]), key=lambda j: score[j] + logp[layout.output_path(j)])
    chain = [layout.output_path(j)]
    for layer in range(layout.layers, 1, -1):
        k = back[layer - 2][j]
        chain.append(layout.path(layer, j, k))
        j = k
    return chain


def with_path(layout: Layout, route: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """`route` (bool, E), or, when it leaves no path from the input to the output, the route with the most likely
    complete chain (best_path) switched on as well: a client always has a model."""
    if has_path(layout, route.tolist()):
        return route
    forced = route.clone()
    forced[best_path(layout, logits)] = True
    return forced


def eq11(outputs: Sequence[torch.Tensor], gates: torch.Tensor) -> torch.Tensor:
    """Eq. (11): Σ_k C_k ũ_k / Σ_k C_k over the predecessors' outputs `outputs` (each (batch, d)) and their paths'
    gates (K,), and 0 when no gate is on. Gates may carry a straight-through gradient: their forward values are
    exactly 0 or 1, so the count is exact."""
    stacked = torch.stack(list(outputs))
    total = (gates.to(stacked.dtype)[:, None, None] * stacked).sum(0)
    count = gates.sum()
    return total / torch.where(count > 0, count, torch.ones_like(count))


def mlp_block(width_in: int, width_out: int, dropout: float, last: bool) -> nn.Sequential:
    """A modular block: Linear → ReLU → Dropout, or, in the last layer, the Linear giving logits alone."""
    if last:
        return nn.Sequential(nn.Linear(width_in, width_out))
    return nn.Sequential(nn.Linear(width_in, width_out), nn.ReLU(), nn.Dropout(dropout))


class Router(nn.Module):
    """The routing hypernetwork of §II-D: per sample h([φx(x), φy(y)] / ‖·‖) ∈ R^E (the summand of Eq. 9); φx is
    `phi_x`'s layers (the encoder's architecture), φy a linear map of the one-hot label, h one linear layer."""

    def __init__(self, phi_x: list[LayerSpec], in_shape: Shape, classes: int, y_dim: int, paths: int) -> None:
        super().__init__()
        self.classes = classes
        self.phi_x = _build_seq(phi_x, in_shape)
        self.phi_y = nn.Linear(classes, y_dim)
        self.h = nn.Linear(_chain_out(phi_x, in_shape)[0] + y_dim, paths)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = torch.cat([self.phi_x(x), self.phi_y(F.one_hot(y, self.classes).to(x.dtype))], dim=1)
        return self.h(F.normalize(z, dim=1))


class ModularNet(nn.Module):
    """The pool of §II-A with its router; forward runs the route `gates` gives while training (set by the client's
    trainer), else the `routing` buffer."""

    def __init__(self, args: dict[str, Any], in_shape: Shape) -> None:
        super().__init__()
        p = _parts(args, in_shape)
        self.layout = p.layout
        self.encoders = nn.ModuleList(_build_seq(p.encoder, in_shape) for _ in range(p.layout.units[0]))
        widths = (p.embedding, *p.widths)
        self.layers = nn.ModuleList(
            nn.ModuleList(mlp_block(widths[i], widths[i + 1], p.dropout, i == len(p.widths) - 1) for _ in range(n))
            for i, n in enumerate(p.layout.units[1:])
        )
        self.router = Router(p.phi_x, in_shape, p.widths[-1], p.y_dim, p.layout.paths)
        e = p.layout.paths
        self.register_buffer("routing", torch.ones(e, dtype=torch.bool))
        # While training: (the hard route as Python bools, the gates tensor of its paths); None: use `routing`.
        self.gates: tuple[tuple[bool, ...], torch.Tensor] | None = None
        self.route: tuple[bool, ...] = (True,) * e  # `routing` as Python bools: which blocks run is static
        self.register_load_state_dict_post_hook(lambda module, keys: module.refresh())

    def refresh(self) -> None:
        """Re-read `routing` into the static route forward follows (after loading or setting it)."""
        self.route = tuple(bool(v) for v in self.routing.tolist())

    def set_routing(self, routing: torch.Tensor) -> None:
        with torch.no_grad():
            self.routing.copy_(routing)
        self.refresh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layout = self.layout
        if self.training and self.gates is not None:
            hard, gates = self.gates
        else:
            hard, gates = self.route, self.routing
        used, reach = used_blocks(layout, hard), reachable(layout, hard)
        # A straight-through gate of a path that is off still needs its predecessor's output for its gradient:
        # blocks that are reachable but unused then run without autograd (they get no gradient either way).
        soft = gates.requires_grad
        outs: dict[tuple[int, int], torch.Tensor] = {}
        for block in sorted(reach):
            if block not in used and not soft:
                continue
            with torch.set_grad_enabled(torch.is_grad_enabled() and block in used):
                outs[block] = self.run(block, x, outs, gates)
        last = layout.layers
        ends = [j for j in range(layout.units[-1]) if (last, j) in outs]
        if not ends:
            return x.new_zeros(len(x), self.layers[-1][0][0].out_features)
        return eq11([outs[(last, j)] for j in ends], gates[[layout.output_path(j) for j in ends]])

    def run(
        self, block: tuple[int, int], x: torch.Tensor, outs: dict[tuple[int, int], torch.Tensor], gates: torch.Tensor
    ) -> torch.Tensor:
        layer, j = block
        if layer == 1:
            return self.encoders[j](x)
        preds = [k for k in range(self.layout.units[layer - 2]) if (layer - 1, k) in outs]
        paths = [self.layout.path(layer, j, k) for k in preds]
        u = eq11([outs[(layer - 1, k)] for k in preds], gates[paths])
        return self.layers[layer - 2][j](u)


@dataclass(frozen=True)
class _Parts:
    layout: Layout
    encoder: list[LayerSpec]
    embedding: int
    widths: tuple[int, ...]
    dropout: float
    phi_x: list[LayerSpec]
    y_dim: int


def _layers(value: Any, what: str) -> list[LayerSpec]:
    if not isinstance(value, list) or not value:
        raise SpecError(f"modular {what} must be a non-empty list of layers, got {value!r}")
    try:
        return [LayerSpec(str(d["type"]), dict(d.get("args", {}))) for d in value]
    except (KeyError, TypeError, AttributeError):
        raise SpecError(f"modular {what} must be layers like {{'type': 'linear', 'args': {{...}}}}") from None


def _vector_out(layers: list[LayerSpec], in_shape: Shape, what: str) -> int:
    out = _chain_out(layers, in_shape)
    if len(out) != 1:
        raise SpecError(f"modular {what} must end in a vector, it gives {list(out)}")
    return out[0]


def _parts(a: dict[str, Any], s: Shape) -> _Parts:
    layout = Layout(tuple(a.get("units", ())))
    encoder, phi_x = _layers(a.get("encoder"), "encoder"), _layers(a.get("router_x"), "router_x")
    widths, dropout, y_dim = tuple(a.get("widths", ())), a.get("dropout", 0.0), a.get("router_y")
    if len(widths) != layout.layers - 1 or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in widths):
        raise SpecError(f"modular widths must give the {layout.layers - 1} block layers' sizes, got {list(widths)}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise SpecError(f"modular dropout must be in [0, 1), got {dropout!r}")
    if isinstance(y_dim, bool) or not isinstance(y_dim, int) or y_dim < 1:
        raise SpecError(f"modular router_y must be a size >= 1, got {y_dim!r}")
    embedding = _vector_out(encoder, s, "encoder")
    _vector_out(phi_x, s, "router_x")
    return _Parts(layout, encoder, embedding, widths, float(dropout), phi_x, y_dim)


def _linear(n_in: int, n_out: int) -> int:
    return n_in * n_out + n_out


def _params(a: dict[str, Any], s: Shape) -> int:
    p = _parts(a, s)
    widths = (p.embedding, *p.widths)
    blocks = sum(n * _linear(widths[i], widths[i + 1]) for i, n in enumerate(p.layout.units[1:]))
    d_x = _vector_out(p.phi_x, s, "router_x")
    router = _sum(p.phi_x, s, "params") + _linear(widths[-1], p.y_dim) + _linear(d_x + p.y_dim, p.layout.paths)
    return p.layout.units[0] * _sum(p.encoder, s, "params") + blocks + router


def _macs(a: dict[str, Any], s: Shape) -> int:
    """Forward MACs of the whole pool (every encoder and block: the most any route costs); the router is charged
    where it runs, over the client's data (methods/fedmn/server.py)."""
    p = _parts(a, s)
    widths = (p.embedding, *p.widths)
    blocks = sum(n * widths[i] * widths[i + 1] for i, n in enumerate(p.layout.units[1:]))
    return p.layout.units[0] * _sum(p.encoder, s, "macs") + blocks


def router_macs(spec: ModelSpec) -> int:
    """Forward MACs per sample of a modular spec's routing hypernetwork (φx, φy, h)."""
    layer, s = modular_layer(spec)
    p = _parts(layer.args, s)
    d_x = _vector_out(p.phi_x, s, "router_x")
    return _sum(p.phi_x, s, "macs") + p.widths[-1] * p.y_dim + (d_x + p.y_dim) * p.layout.paths


def _activations(a: dict[str, Any], s: Shape) -> int:
    """Elements per sample kept for backward: every encoder's and block's outputs, plus the router's (its gradient
    pass runs over training batches too)."""
    p = _parts(a, s)
    widths = (p.embedding, *p.widths)
    blocks = sum(n * widths[i + 1] * (1 if i == len(p.widths) - 1 else 3) for i, n in enumerate(p.layout.units[1:]))
    return p.layout.units[0] * _sum_activations(p.encoder, s) + blocks + _sum_activations(p.phi_x, s)


register_layer(
    LAYER,
    LayerType(
        out_shape=lambda a, s: (_parts(a, s).widths[-1],),
        build=lambda a, s: ModularNet(a, s),
        params=_params,
        macs=_macs,
        activations=_activations,
    ),
)


def modular_layer(spec: ModelSpec) -> tuple[LayerSpec, Shape]:
    """The spec's `modular` layer and its input shape; SpecError unless the spec is one block of that one layer."""
    block = spec.blocks[0]
    if len(spec.blocks) != 1 or len(block.layers) != 1 or block.layers[0].type != LAYER:
        raise SpecError(
            f"model {spec.name!r} is not a modular network (one block holding one `modular` layer, e.g. the zoo's "
            "fedmn_2x2x2_cnn1)"
        )
    return block.layers[0], block.in_shape


def layout_of(spec: ModelSpec) -> Layout:
    """The pool layout of a modular spec (SpecError for any other)."""
    layer, s = modular_layer(spec)
    return _parts(layer.args, s).layout


def is_modular(spec: ModelSpec) -> bool:
    try:
        modular_layer(spec)
    except SpecError:
        return False
    return True


PREFIX = "blocks.0.0."  # where the modular layer's tensors sit in a SpecModel's state


def block_of(name: str) -> tuple[int, int] | str | None:
    """Which part a state tensor of a modular model belongs to: a block (layer, index), ROUTER, or None (the
    client's own `routing`, never exchanged)."""
    rest = name[len(PREFIX) :].split(".")
    if rest[0] == "encoders":
        return (1, int(rest[1]))
    if rest[0] == "layers":
        return (int(rest[1]) + 2, int(rest[2]))
    if rest[0] == ROUTER:
        return ROUTER
    return None


def downloaded(names: Sequence[str], layout: Layout, route: Route) -> list[str]:
    """The state tensors (of `names`) a client training `route` is sent (§II-E): the router's, and those of every
    block the route reaches (training computes them all; module docstring)."""
    reach = reachable(layout, route)
    return [n for n in names if (part := block_of(n)) == ROUTER or part in reach]


def uploaded(names: Sequence[str], layout: Layout, route: Route) -> list[str]:
    """The state tensors a client that trained `route` sends back: the router's and its used blocks'."""
    used = used_blocks(layout, route)
    return [n for n in names if (part := block_of(n)) == ROUTER or part in used]


def block_names(names: Sequence[str], layout: Layout, route: Route) -> list[str]:
    """The state tensors of the blocks `route` uses, without the router (what evaluation needs)."""
    return [n for n in uploaded(names, layout, route) if block_of(n) != ROUTER]


def router_has_batchnorm(spec: ModelSpec) -> bool:
    """Whether the spec's router (φx) holds BatchNorm layers, whose statistics the client re-estimates each task."""
    layer, s = modular_layer(spec)
    with torch.device("meta"):
        phi_x = _build_seq(_parts(layer.args, s).phi_x, s)
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in phi_x.modules())


def net_of(model: SpecModel) -> ModularNet:
    """The ModularNet inside a model built from a modular spec."""
    net = model.blocks[0][0]
    if not isinstance(net, ModularNet):
        raise SpecError(f"model {model.spec.name!r} is not a modular network")
    return net


def route_text(route: Route) -> str:
    """A route as a string of 0/1 (metrics, summaries)."""
    return "".join("1" if v else "0" for v in route)


def elements(shapes: dict[str, tuple[tuple[int, ...], Any]], names: Sequence[str]) -> int:
    """How many numbers the tensors `names` hold (parameters transmitted, §IV-D)."""
    return sum(math.prod(shapes[n][0]) for n in names)
