"""A network profiled block by block for the three ways of splitting training (`src.scaling.net_profile`): one
training forward on the CPU, at 1 and at 2 samples, with hooks that count each block's multiply-adds, its output
and every tensor autograd saves for backward (`torch.autograd.graph.saved_tensors_hooks`).

The blocks are the pipeline's (`src.strategies.pipeline_stages.named_blocks`); the layers tensor parallelism
splits are those of `src.strategies.tensor_plans` (`SPLIT_LAYERS` names them by their place in the network, as the
plans do; `tests/test_forecast_three_ways.py` checks the two agree, share for share, under a fake process group).
The model files are not changed and nothing is trained: the model is built, run on two random batches, dropped.
"""

import json
import re
from functools import cache

from src.scaling.model_counts import built_module
from src.scaling.net_profile import (CLOSES_SPLIT, OPENS_SPLIT, SPLIT_PARAMETERS, Block, Exchange, NetProfile, Param,
                                     Saved)

#: the layers `src.strategies.tensor_plans` splits, per network class: (pattern of the layer's name, kind)
SPLIT_LAYERS = {
    "LeNet": [(r"features\.0", "out"), (r"features\.3", "in"), (r"classifier\.1", "colwise"),
              (r"classifier\.3", "rowwise")],
    "ResNet18": [(r"stages\.\d+\.\d+\.conv1", "out"), (r"stages\.\d+\.\d+\.bn1", "bn"),
                 (r"stages\.\d+\.\d+\.conv2", "in")],
}
#: the size a kind splits, by the layer's attribute: the shares must divide it
_SPLIT_SIZE = {"out": "out_channels", "in": "in_channels", "bn": "num_features", "colwise": "out_features",
               "rowwise": "in_features"}


def split_layers(net: object) -> dict[str, str]:
    """The layers that tensor parallelism splits in `net`, by `SPLIT_LAYERS`.

    Args:
        net: The network (an nn.Module), e.g. a LeNet or a ResNet18.

    Returns:
        Layer name -> kind (a key of `src.scaling.net_profile.SPLIT_PARAMETERS`); empty for a network without a plan.
    """
    patterns = SPLIT_LAYERS.get(type(net).__name__, [])
    return {name: kind for name, _ in net.named_modules() for pattern, kind in patterns
            if re.fullmatch(pattern, name)}


class _Recorder:
    """The hooks' state during one forward of `batch` samples."""

    def __init__(self, batch: int, exclude: set[int]) -> None:
        self.batch, self.exclude = batch, exclude
        self.block = 0
        self.split = False  # between a layer split by outputs and the next split by inputs
        self.storages: dict[int, int] = {}  # storage address -> index, in order of first saving
        self.sizes: list[tuple[int, bool]] = []  # (bytes, split) per index
        self.saved: list[set[int]] = []  # per block
        self.loss: set[int] = set()
        self.in_loss = False
        self.macs: list[float] = []
        self.split_macs: list[float] = []
        self.outputs: list[int] = []
        self.exchanges: list[tuple[str, str, int]] = []

    def pack(self, t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.exclude or storage.nbytes() == 0:
            return t
        if key not in self.storages:
            self.storages[key] = len(self.sizes)
            self.sizes.append((storage.nbytes(), self.split))
        (self.loss if self.in_loss else self.saved[self.block]).add(self.storages[key])
        return t


def _record(module, blocks, layers: dict[str, str], batch: int) -> _Recorder:
    """One training forward of `batch` random samples through `blocks` and the module's loss, under hooks."""
    import torch
    from torch import nn

    net = module.net
    exclude = {t.untyped_storage().data_ptr() for t in (*net.parameters(), *net.buffers())}
    rec = _Recorder(batch, exclude)
    handles = []
    for index, (_, block) in enumerate(blocks):
        def enter(_m, _inputs, index=index):
            rec.block = index
            rec.saved.append(set())
            rec.macs.append(0.0)
            rec.split_macs.append(0.0)

        handles += [block.register_forward_pre_hook(enter),
                    block.register_forward_hook(lambda _m, _i, out: rec.outputs.append(
                        out.numel() * out.element_size() // batch))]
    for name, layer in net.named_modules():
        kind = layers.get(name)
        if isinstance(layer, (nn.Conv2d, nn.Linear)) or kind:
            handles.append(layer.register_forward_hook(_layer_hook(rec, name, kind)))
    x = torch.randn(batch, 1, 28, 28, dtype=next(net.parameters()).dtype)
    try:
        with torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
            for _, block in blocks:
                x = block(x)
            rec.in_loss = True
            module.loss_fn(x, torch.zeros(batch, dtype=torch.long))
    finally:
        for h in handles:
            h.remove()
    rec.outputs.append(x.shape[-1] * x.element_size())  # the logits, per sample
    return rec


def _layer_hook(rec: _Recorder, name: str, kind: str | None):
    """A forward hook counting `name`'s multiply-adds and, for a split layer, opening or closing the split and
    noting the allreduce its split makes."""
    from src.strategies.pipeline_stages import layer_macs  # the count the pipeline's `auto` cut balances

    def hook(layer, inputs, output):
        macs = layer_macs(layer, output)
        rec.macs[rec.block] += macs
        if kind is None:
            return
        rec.split_macs[rec.block] += macs
        if kind in OPENS_SPLIT:
            rec.split = True
            if inputs[0].requires_grad:  # its input's gradient is a partial sum on each process
                rec.exchanges.append((name, "backward", inputs[0].numel() * inputs[0].element_size() // rec.batch))
        elif kind in CLOSES_SPLIT:
            rec.split = False
            rec.exchanges.append((name, "forward", output.numel() * output.element_size() // rec.batch))

    return hook


@cache
def _profile(class_path: str, init_args_json: str) -> NetProfile:
    from src.strategies.pipeline_stages import named_blocks

    module = built_module(class_path, json.loads(init_args_json))
    cls_name, net = type(module).__name__, module.net.train()
    blocks = named_blocks(net)
    layers = split_layers(net)
    one, two = _record(module, blocks, layers, 1), _record(module, blocks, layers, 2)
    if len(one.sizes) != len(two.sizes):
        raise RuntimeError(f"{cls_name}'s forward saves different tensors at 1 and 2 samples; cannot profile it")
    saved = tuple(Saved(2 * a - b, b - a, split) for (a, split), (b, _) in zip(one.sizes, two.sizes))
    params = {name: p for name, p in net.named_parameters() if p.requires_grad}
    block_params = []
    for block_name, block in blocks:
        own = []
        for sub_name, p in block.named_parameters():
            full = f"{block_name}.{sub_name}"
            layer, _, tensor = full.rpartition(".")
            if full in params:
                own.append(Param(full, tuple(p.shape), SPLIT_PARAMETERS.get(layers.get(layer), {}).get(tensor)))
        block_params.append(tuple(own))
    modules = dict(net.named_modules())
    divisors = {name: getattr(modules[name], _SPLIT_SIZE[kind]) for name, kind in layers.items()}
    profiled = tuple(Block(name, block_params[i], one.macs[i], one.split_macs[i], frozenset(one.saved[i]),
                           one.outputs[i]) for i, (name, _) in enumerate(blocks))
    element = next(net.parameters()).element_size()
    return NetProfile(cls_name, type(net).__name__, profiled, saved, frozenset(one.loss), one.outputs[-1], layers,
                      tuple(Exchange(*e) for e in one.exchanges), divisors, element)


def profile_network(class_path: str, init_args: dict | None = None) -> NetProfile:
    """Build the LightningModule `class_path` and profile its network block by block (cached per arguments).

    Args:
        class_path: e.g. src.models.classifier.ResNet18Classifier.
        init_args: Its keyword arguments (from the config).

    Returns:
        The profile: per block its parameters (with tensor parallelism's split dimension), forward multiply-adds,
        saved tensors (bytes = fixed + per sample x samples) and output bytes per sample; the loss's saved tensors;
        tensor parallelism's split layers and allreduces.

    Raises:
        ImportError, AttributeError: `class_path` names no importable class.
        RuntimeError: A forward that saves different tensors at different batch sizes.
    """
    return _profile(class_path, json.dumps(init_args or {}, sort_keys=True))
