"""Model-state memory per device under the ZeRO stages: parameters, gradients and optimizer state, in bytes.

Pure arithmetic: it loads neither torch nor Lightning. The formulas are those of Rajbhandari, Rasley, Ruwase & He,
"ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC 2020 (arXiv:1910.02054), section 5 and
Figure 1, for a model of Ψ parameters on N data-parallel devices with p, g and k bytes per element of parameters,
gradients and optimizer state:

    stage 0 (plain data parallelism)                    (p + g + k)·Ψ
    stage 1 (optimizer state partitioned)               (p + g)·Ψ + k·Ψ/N
    stage 2 (optimizer state and gradients)             p·Ψ + (g + k)·Ψ/N
    stage 3 (parameters too: FSDP's FULL_SHARD)         (p + g + k)·Ψ/N

The paper's mixed-precision Adam has p = g = 2 and k = K = 12 (float32 master weights, momentum and variance).
Activations, temporary buffers and allocator fragmentation are not model state and are not counted.
"""

from dataclasses import dataclass

from src.scaling.step_precision import config_precision

STAGES = (0, 1, 2, 3)
# optimizer state tensors of the size of the parameters, per optimizer (torch.optim): SGD's momentum buffer;
# Adam's and AdamW's exp_avg and exp_avg_sq (their per-tensor `step` counters are scalars, left out)
OPTIMIZER_STATES = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2}
PRECISIONS = ("fp32", "mixed", "fp64")
GIB = 2**30


@dataclass(frozen=True)
class BytesPerElement:
    """Bytes per parameter element that each part of the model state takes."""

    params: int  #: Bytes of the parameters (p).
    grads: int  #: Bytes of the gradients (g).
    optimizer: int  #: Bytes of the optimizer state (k), master weights included.


def bytes_per_element(optimizer: str, precision: str) -> BytesPerElement:
    """The bytes per parameter element of parameters, gradients and optimizer state.

    "fp32": 4, 4 and 4 per optimizer state tensor (also what PyTorch's autocast, Lightning's 16-mixed and
    bf16-mixed keep: float32 weights and gradients). "mixed": the ZeRO paper's mixed-precision training (section
    3.1): 2, 2 and a float32 master copy of the weights, 4, plus 4 per state tensor (Adam: K = 12). "fp64": 8 each.

    Args:
        optimizer: A key of `OPTIMIZER_STATES` (sgd, sgd_momentum, adam, adamw).
        precision: One of `PRECISIONS` (fp32, mixed, fp64).

    Raises:
        ValueError: An unknown optimizer or precision (the valid ones are named).
    """
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose from {', '.join(OPTIMIZER_STATES)}")
    states = OPTIMIZER_STATES[optimizer]
    sizes = {"fp32": (4, 4, 4 * states), "mixed": (2, 2, 4 + 4 * states), "fp64": (8, 8, 8 * states)}
    if precision not in sizes:
        raise ValueError(f"unknown memory precision {precision!r}; choose from {', '.join(PRECISIONS)}")
    return BytesPerElement(*sizes[precision])


def _kept_whole(stage: int, sizes: BytesPerElement) -> list[tuple[int, bool]]:
    """(bytes per element, kept whole on every device) of parameters, gradients and optimizer state at `stage`:
    stage 1 partitions the optimizer state, 2 the gradients too, 3 the parameters too."""
    if stage not in STAGES:
        raise ValueError(f"unknown ZeRO stage {stage}; choose from {', '.join(map(str, STAGES))}")
    return [(sizes.params, stage < 3), (sizes.grads, stage < 2), (sizes.optimizer, stage < 1)]


def state_bytes(parameters: int, devices: int, stage: int, sizes: BytesPerElement) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes on the fullest device at `stage`, a partition holding
    ceil(Ψ / N) elements.

    Raises:
        ValueError: An unknown stage.
    """
    part = -(-parameters // devices)
    return tuple(b * (parameters if whole else part) for b, whole in _kept_whole(stage, sizes))


def model_state_bytes(parameters: int, devices: int, stage: int, sizes: BytesPerElement) -> int:
    """Bytes of model state on the fullest device, an integer: the sum of `state_bytes` (ZeRO, arXiv:1910.02054,
    section 5, Figure 1; the paper writes Ψ/N for the largest partition, ceil(Ψ / N)).

    Args:
        parameters: Ψ, the trainable parameters (elements), >= 1.
        devices: N, the data-parallel devices, >= 1.
        stage: ZeRO stage, 0 to 3.
        sizes: Bytes per element (`bytes_per_element`).

    Raises:
        ValueError: Ψ or N below 1, or an unknown stage.
    """
    if parameters < 1 or devices < 1:
        raise ValueError(f"parameters and devices must be >= 1, got {parameters} and {devices}")
    return sum(state_bytes(parameters, devices, stage, sizes))


def fewest_devices(parameters: int, stage: int, sizes: BytesPerElement, limit_bytes: float) -> int | None:
    """The fewest devices N whose model state per device (`model_state_bytes`) is at most `limit_bytes`.

    The bytes never grow with N and stop falling at N = Ψ (one element per device), so a bisection over 1..Ψ
    answers exactly, with no cap on N. None when no device count fits (stage 0 whenever one device does not).

    Args:
        parameters, stage, sizes: As in `model_state_bytes`.
        limit_bytes: Memory per device in bytes (> 0); state of exactly this size fits.

    Raises:
        ValueError: Ψ below 1, a limit that is not > 0, or an unknown stage.
    """
    if not limit_bytes > 0:
        raise ValueError(f"the memory limit must be > 0 bytes, got {limit_bytes}")
    if model_state_bytes(parameters, parameters, stage, sizes) > limit_bytes:
        return None
    low, high = 1, parameters  # high always fits
    while low < high:
        middle = (low + high) // 2
        if model_state_bytes(parameters, middle, stage, sizes) <= limit_bytes:
            high = middle
        else:
            low = middle + 1
    return low


def never_fits_reason(parameters: int, stage: int, sizes: BytesPerElement, limit_bytes: float) -> str:
    """Why no device count brings `stage`'s model state down to `limit_bytes`: the part kept whole on every device,
    in a clause such as "it keeps the 23.21 GiB of parameters, gradients and optimizer state whole on every device,
    over the limit whatever the count" (GiB = 2**30 bytes).

    Args:
        parameters, stage, sizes: As in `model_state_bytes`.
        limit_bytes: Memory per device in bytes.

    Raises:
        ValueError: An unknown stage.
    """
    whole = sum(b for b, kept in _kept_whole(stage, sizes) if kept)
    if stage == 3:
        least = model_state_bytes(parameters, parameters, stage, sizes)
        return f"even one element per device ({parameters:,} devices) takes {least} bytes"
    kept = {0: "parameters, gradients and optimizer state", 1: "parameters and gradients", 2: "parameters"}[stage]
    over = "over the limit" if whole * parameters > limit_bytes else "too close to the limit for its partitioned part"
    return f"it keeps the {whole * parameters / GIB:.4g} GiB of {kept} whole on every device, {over} whatever the count"


# src.models.classifier.ImageClassifier's defaults, for a config that leaves them out
CLASSIFIER_OPTIMIZER, CLASSIFIER_MOMENTUM = "sgd", 0.9


@dataclass(frozen=True)
class MemoryPlan:
    """What the model-state memory is computed for."""

    parameters: int  #: Ψ, the trainable parameters.
    optimizer: str  #: A key of `OPTIMIZER_STATES`.
    precision: str  #: fp32, mixed or fp64.
    sizes: BytesPerElement  #: Bytes per element of parameters, gradients and optimizer state.
    source: str  #: Where the optimizer and the precision come from, in words.
    memory_gib: float | None = None  #: The device memory to fit into, GiB (2**30 bytes), or None.


def config_optimizer(cfg: dict) -> str:
    """The optimizer an experiment config trains with: model.init_args.optimizer, "sgd" with a momentum > 0 being
    "sgd_momentum" (ImageClassifier's defaults, sgd and momentum 0.9, where the config sets none).

    Args:
        cfg: The experiment config as read from YAML.

    Raises:
        ValueError: An optimizer whose state size is not known (the option that replaces it is named).
    """
    init = (cfg.get("model") or {}).get("init_args") or {}
    name = init.get("optimizer", CLASSIFIER_OPTIMIZER)
    if name == "sgd":
        return "sgd_momentum" if float(init.get("momentum", CLASSIFIER_MOMENTUM)) > 0 else "sgd"
    if name not in OPTIMIZER_STATES:
        raise ValueError(f"the config's optimizer {name!r} has no known state size: give --optimizer "
                         f"({', '.join(OPTIMIZER_STATES)})")
    return name


def memory_plan(parameters: int, optimizer: str | None, precision: str | None, memory_gib: float | None,
                cfg: dict | None) -> MemoryPlan:
    """The plan of `parameters` with the options given, the rest from `cfg` (None: a network known by its count).

    Unset, the optimizer is the config's (`config_optimizer`), or Adam without a config; the precision is fp64
    when the config trains in 64-true (`src.scaling.step_precision.config_precision`), else fp32.

    Raises:
        ValueError: An unknown optimizer or precision, or a config optimizer of unknown state size.
    """
    if optimizer is not None:
        optimizer_source = "[user: --optimizer]"
    elif cfg is None:
        optimizer, optimizer_source = "adam", "[assumed: no config to read it from]"
    else:
        optimizer, optimizer_source = config_optimizer(cfg), "[config: model.init_args]"
    if precision is not None:
        precision_source = "[user: --memory_precision]"
    elif cfg is None:
        precision, precision_source = "fp32", "[assumed: no config to read it from]"
    else:
        trains_in = config_precision(cfg)
        precision, precision_source = "fp64" if trains_in == "64-true" else "fp32", f"[config: {trains_in}]"
    return MemoryPlan(parameters, optimizer, precision, bytes_per_element(optimizer, precision),
                      f"optimizer {optimizer_source}, precision {precision_source}", memory_gib)


def stage_gib(plan: MemoryPlan, devices: int) -> list[float]:
    """Model state per device at each ZeRO stage 0..3 on `devices` devices, GiB (2**30 bytes)."""
    return [model_state_bytes(plan.parameters, devices, s, plan.sizes) / GIB for s in STAGES]
