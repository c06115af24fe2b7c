"""The forecast's model-state memory: the optimizer and precision it assumes (from the options or the config), its
section of forecast.md, its columns of forecast.csv and the answer lines it prints. `src.scaling.memory` computes."""

from collections.abc import Sequence
from dataclasses import dataclass

from src.scaling.memory import (GIB, OPTIMIZER_STATES, STAGES, BytesPerElement, bytes_per_element, fewest_devices,
                                model_state_bytes, never_fits_reason)
from src.scaling.step_precision import config_precision

# src.models.classifier.ImageClassifier's defaults, for a config that leaves them out
CLASSIFIER_OPTIMIZER, CLASSIFIER_MOMENTUM = "sgd", 0.9
_HEADER = ["devices", "stage 0 GiB", "stage 1 GiB", "stage 2 GiB", "stage 3 GiB (FSDP FULL_SHARD)"]
_LEFT_OUT = ("Activations, temporary buffers (gradient buckets, all-gather and reduce-scatter buffers) and the "
             "allocator's fragmentation are NOT included: a device needs more memory than this.")


@dataclass(frozen=True)
class MemoryPlan:
    """What the model-state memory is computed for.

    Args:
        parameters: Ψ, the trainable parameters.
        optimizer: A key of `src.scaling.memory.OPTIMIZER_STATES`.
        precision: fp32, mixed or fp64.
        sizes: Bytes per element of parameters, gradients and optimizer state.
        source: Where the optimizer and the precision come from, in words.
        memory_gib: The device memory to fit into, GiB (2**30 bytes), or None.
    """

    parameters: int
    optimizer: str
    precision: str
    sizes: BytesPerElement
    source: str
    memory_gib: float | None = None


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
    when the config trains in 64-true, else fp32.

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


def assumptions(plan: MemoryPlan) -> str:
    """One sentence: Ψ, the optimizer, the precision and the bytes per element they give, with their sources."""
    s = plan.sizes
    return (f"Ψ = {plan.parameters:,} parameters; {plan.optimizer} ({OPTIMIZER_STATES[plan.optimizer]} state "
            f"tensor(s) the size of the parameters) in {plan.precision}: {s.params} + {s.grads} + {s.optimizer} "
            f"bytes per parameter of parameters + gradients + optimizer state ({plan.source})")


def answer_lines(plan: MemoryPlan) -> list[str]:
    """Per stage, the fewest devices whose model state fits in `plan.memory_gib` ([] without it).

    Returns:
        Lines such as "stage 1: fits in 12 GiB from 3 devices (11.61 GiB each)" or "stage 0: never fits in
        12 GiB: it keeps the 23.21 GiB of ... whole on every device, over the limit whatever the count".
    """
    if plan.memory_gib is None:
        return []
    limit, lines = plan.memory_gib * GIB, []
    for stage in STAGES:
        n = fewest_devices(plan.parameters, stage, plan.sizes, limit)
        if n is None:
            lines.append(f"stage {stage}: never fits in {plan.memory_gib:g} GiB: "
                         f"{never_fits_reason(plan.parameters, stage, plan.sizes, limit)}")
        else:
            each = model_state_bytes(plan.parameters, n, stage, plan.sizes) / GIB
            lines.append(f"stage {stage}: fits in {plan.memory_gib:g} GiB from {n:,} device{'s' * (n > 1)} "
                         f"({each:.4g} GiB each)")
    return lines


def markdown_section(plan: MemoryPlan, devices: Sequence[int]) -> list[str]:
    """forecast.md's "Model-state memory per device": the table (one row per device count), the assumptions, what
    is left out and, with a memory limit, the answer lines."""
    lines = ["## Model-state memory per device", "",
             f"Predicted from the parameter count, not measured. {assumptions(plan)}. Formulas of ZeRO "
             "(Rajbhandari et al., SC 2020, arXiv:1910.02054, section 5): stage 0 is DDP's and this "
             "project's strategy's; stages 1 and 2 this project runs as `zero_stage: 1` and `2`, and stage 3 "
             "as FSDP's FULL_SHARD (`configs/strategy/fsdp_cpu_full_shard.yaml`); DeepSpeed's "
             "`zero_optimization.stage` numbers them alike. A partition holds ceil(Ψ / devices) elements. "
             "GiB = 2^30 bytes.", "",
             "| " + " | ".join(_HEADER) + " |", "|" + "---|" * len(_HEADER)]
    lines += [f"| {d} | " + " | ".join(f"{g:.4g}" for g in stage_gib(plan, d)) + " |" for d in devices]
    lines += ["", _LEFT_OUT]
    answers = answer_lines(plan)
    if answers:
        lines += ["", f"Fewest devices whose model state fits in {plan.memory_gib:g} GiB:", "",
                  *[f"- {a}" for a in answers]]
    return lines
