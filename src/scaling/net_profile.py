"""What the three ways of splitting training need to know of a network, block by block, as plain numbers: each
block's parameters, forward multiply-adds, the tensors autograd saves for backward and the bytes of its output, and
what tensor parallelism splits (src/strategies/tensor_plans.py) and exchanges.

Pure Python: `src.scaling.layer_profile.profile_network` fills these classes from one tiny CPU forward of the model;
the sums here (a stage's saved bytes, a process's share of the parameters) load neither torch nor Lightning.

Units: bytes, elements, multiply-adds per sample (one 28x28 image).
"""

from collections.abc import Iterable
from dataclasses import dataclass

#: what each kind of split layer in `src.strategies.tensor_plans` shares out: (tensor, dimension) of every split
#: parameter; parameters not named stay whole on every process
SPLIT_PARAMETERS = {
    "out": {"weight": 0, "bias": 0},  # conv_by_output_channels: weight and bias Shard(0)
    "in": {"weight": 1},  # conv_by_input_channels: weight Shard(1), the bias whole (added after the allreduce)
    "bn": {"weight": 0, "bias": 0},  # batchnorm_by_channels (its running statistics too, buffers: not counted)
    "colwise": {"weight": 0, "bias": 0},  # torch's ColwiseParallel on nn.Linear: weight (out, in) Shard(0)
    "rowwise": {"weight": 1},  # torch's RowwiseParallel: weight Shard(1), the bias replicated
}
#: the kinds after which activations are split by channels or units, and those after which they are whole again
OPENS_SPLIT, CLOSES_SPLIT = ("out", "colwise"), ("in", "rowwise")


@dataclass(frozen=True)
class Saved:
    """One tensor autograd saves for backward (one storage: views of it count once): bytes = fixed + per_sample x
    samples.

    Args:
        fixed: Bytes that do not grow with the batch (BatchNorm's per-channel statistics).
        per_sample: Bytes per sample.
        split: Saved inside a tensor-parallel split (between a layer split by outputs and the one split by inputs):
            each of P processes holds 1/P of it.
    """

    fixed: int
    per_sample: int
    split: bool = False

    def bytes(self, samples: float, shares: int = 1) -> float:
        """Bytes at `samples` samples, on one of `shares` processes (a split tensor's share)."""
        whole = self.fixed + self.per_sample * samples
        return whole / shares if self.split else whole


@dataclass(frozen=True)
class Param:
    """One parameter tensor.

    Args:
        name: Its name under the network, e.g. "features.0.weight".
        shape: Its whole shape.
        split_dim: The dimension tensor parallelism splits, or None: whole on every process.
    """

    name: str
    shape: tuple[int, ...]
    split_dim: int | None = None

    @property
    def elements(self) -> int:
        """Elements of the whole tensor."""
        n = 1
        for size in self.shape:
            n *= size
        return n


@dataclass(frozen=True)
class Block:
    """A block where a pipeline can be cut (`src.strategies.pipeline_stages.named_blocks`).

    Args:
        name: Its dotted name, e.g. "features.3" or "stages.2.0".
        params: Its parameters.
        macs: Forward multiply-adds per sample of its conv and dense layers.
        split_macs: Of those, the ones in layers tensor parallelism splits (each process does 1/P of them).
        saved: Indices (into `NetProfile.saved`) of every tensor it saves for backward, its input included when it
            saves that.
        output: Bytes of its output per sample.
    """

    name: str
    params: tuple[Param, ...]
    macs: float
    split_macs: float
    saved: frozenset[int]
    output: int


@dataclass(frozen=True)
class Exchange:
    """One allreduce that tensor parallelism makes per step (DTensor's Partial -> Replicate).

    Args:
        layer: The split layer, e.g. "features.3".
        direction: "forward" (the partial sums of a layer split by inputs) or "backward" (the gradient of the whole
            input of a layer split by outputs, when that input needs one).
        per_sample: Bytes of the tensor per sample.
    """

    layer: str
    direction: str
    per_sample: int


@dataclass(frozen=True)
class NetProfile:
    """A network block by block.

    Args:
        class_name: The LightningModule's class, e.g. "LeNetClassifier".
        net_name: The network's class, e.g. "LeNet" (the key of `src.strategies.tensor_plans.PLANS`).
        blocks: Its blocks in forward order.
        saved: Every tensor saved for backward in one training forward, the loss's included.
        loss_saved: Indices of those the loss saves (held by the last pipeline stage).
        logits: Bytes of the logits per sample.
        split_layers: Tensor parallelism's split layers, name -> kind (a key of `SPLIT_PARAMETERS`); empty: no plan.
        exchanges: Tensor parallelism's allreduces per step.
        divisors: Every split layer's split size (channels or units), name -> size, which the shares must divide.
        element_bytes: Bytes per activation element of the profiled forward (4: float32).
    """

    class_name: str
    net_name: str
    blocks: tuple[Block, ...]
    saved: tuple[Saved, ...]
    loss_saved: frozenset[int]
    logits: int
    split_layers: dict[str, str]
    exchanges: tuple[Exchange, ...]
    divisors: dict[str, int]
    element_bytes: int = 4

    @property
    def names(self) -> list[str]:
        """The blocks' names in order."""
        return [b.name for b in self.blocks]

    @property
    def macs(self) -> float:
        """Forward multiply-adds per sample of the whole network."""
        return sum(b.macs for b in self.blocks)

    @property
    def parameters(self) -> int:
        """Elements of all parameters."""
        return sum(p.elements for b in self.blocks for p in b.params)


def saved_bytes(profile: NetProfile, indices: Iterable[int], samples: float, shares: int = 1) -> float:
    """Bytes of the saved tensors `indices` at `samples` samples on one of `shares` tensor-parallel processes.

    Args:
        profile: The network.
        indices: Indices into `profile.saved`, each counted once.
        samples: Samples in the (micro-)batch.
        shares: Tensor-parallel degree (1: nothing split).

    Returns:
        Bytes (a float: a split tensor's share).
    """
    return sum(profile.saved[i].bytes(samples, shares) for i in set(indices))


def stage_saved(profile: NetProfile, first: int, end: int, last: bool) -> frozenset[int]:
    """The tensors blocks first..end-1 save for backward (each once), with the loss's on the last stage.

    Args:
        profile: The network.
        first: Index of the stage's first block.
        end: Index after its last block.
        last: Whether it is the pipeline's last stage (it computes the loss).

    Returns:
        Indices into `profile.saved`.
    """
    held = set().union(*(profile.blocks[i].saved for i in range(first, end)))
    return frozenset(held | profile.loss_saved if last else held)


def local_elements(param: Param, shares: int) -> int:
    """Elements of `param` on one of `shares` tensor-parallel processes.

    Args:
        param: The parameter.
        shares: Tensor-parallel degree; it divides the split dimension (`check_shares`).

    Returns:
        Its elements, or its share of them when it is split.
    """
    return param.elements if param.split_dim is None else param.elements // shares


def check_shares(profile: NetProfile, shares: int) -> None:
    """Raise when tensor parallelism cannot split `profile`'s network into `shares` equal shares.

    Args:
        profile: The network.
        shares: Tensor-parallel degree.

    Raises:
        ValueError: No plan for the network (src/strategies/tensor_plans.py has none), or a split layer whose
            channels or units `shares` does not divide (the message names the layer and the counts that do).
    """
    if not profile.split_layers:
        raise ValueError(f"tensor parallelism has no plan for {profile.net_name} (src/strategies/tensor_plans.py "
                         "plans LeNet and ResNet18); leave tensor out of --ways")
    for layer, size in profile.divisors.items():
        if size % shares:
            fits = [d for d in range(2, size + 1) if all(s % d == 0 for s in profile.divisors.values())]
            raise ValueError(f"tensor parallelism splits {layer} ({size} channels or units) into {shares} equal "
                             f"shares, and {shares} does not divide {size}; tensor-parallel degrees that split "
                             f"every layer of {profile.net_name}: {', '.join(map(str, fits[:8])) or 'none'}")
