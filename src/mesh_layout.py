"""`layout: {data: D, pipeline: P, tensor: T}`: the three ways to split training, chosen by their degrees alone.

The CLI turns a layout into the Trainer's `devices` (D x P x T processes, on all nodes) and `strategy`, before
anything is built, so a layout runs exactly what the strategy it names runs, and the run's config.yaml records both:

| data x pipeline x tensor | strategy |
|---|---|
| 1 x 1 x 1 | one device (`auto`) |
| D x 1 x 1 | ours across D processes (`SplitAllreduceStrategy`, one replica each) |
| D x 1 x T | `TensorParallelStrategy` (`replicas` D) |
| D x P x T, P > 1 | `PipelineStrategy` (`pipelines` D, P stages, `tensor` T) |

The shape follows torchtitan's `ParallelDims` (one set of named degrees whose product is the world size, each way
applied on its own dimension of one device mesh; github.com/pytorch/torchtitan, torchtitan/distributed). Options of
one way (a pipeline's `cuts`, `schedule`, `n_microbatches`; the data dimension's `compression`, `zero_stage`,
`overlap`, unless they say none, 0 or false) are refused in a layout without that way. This module only writes
configuration: the strategies check the rest (a cut that does not fit the network, micro-batches that do not divide
the batch) as they do for a config that names them.
"""

from dataclasses import dataclass
from typing import Any, Literal

from jsonargparse import Namespace

from src.layout import degrees_words
from src.strategies.comm.compression import CompressionSpec
from src.strategies.processes import ProcessStart

# the strategy each shape of layout runs, and the init arg that holds its data degree
_STRATEGIES = {"data": ("src.strategies.SplitAllreduceStrategy", "replicas_per_process"),
               "tensor": ("src.strategies.TensorParallelStrategy", "replicas"),
               "pipeline": ("src.strategies.PipelineStrategy", "pipelines")}
# the options of one way: which degree must be above 1 for each
_OPTION_WAYS = {"cuts": "pipeline", "schedule": "pipeline", "n_microbatches": "pipeline", "compression": "data",
                "zero_stage": "data", "overlap": "data"}


@dataclass
class MeshLayout:
    """The degrees of a run's device mesh, and the options of its ways; an option left out (None) is the strategy's
    default.

    Args:
        data: D, copies of the model side by side, each taking an equal part of every global batch; their
            gradients are summed by ours' exchange (buckets, ring allreduce).
        pipeline: P, stages the network is cut into by layers, one process each (torch's pipeline schedules).
        tensor: T, processes that share every split layer of a stage, by the network's tensor plan (DTensor).
        cuts: The block each later stage begins with, e.g. [classifier] for LeNet, or auto (pipeline above 1).
        schedule: gpipe, 1f1b, interleaved_1f1b or interleaved_zero_bubble (pipeline above 1).
        n_microbatches: Micro-batches per pipeline per step; must divide the global batch / data (pipeline above 1).
        compression: How gradients travel between the copies: `kind` none, bf16 or powersgd with its settings
            (data above 1).
        zero_stage: 0, 1 (each copy keeps a partition of the optimizer state) or 2 (of the gradients too) (data
            above 1).
        overlap: Exchange each bucket during backward once its gradients are ready (data above 1; not with a
            pipeline).
        processes: How the processes start and wait for each other (backend, timeout, start method).
    """

    data: int = 1
    pipeline: int = 1
    tensor: int = 1
    cuts: list[str] | Literal["auto"] | None = None
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble"] | None = None
    n_microbatches: int | None = None
    compression: CompressionSpec | None = None
    zero_stage: Literal[0, 1, 2] | None = None
    overlap: bool | None = None
    processes: ProcessStart | None = None


def strategy_for_layout(layout: Namespace) -> tuple[int, Any]:
    """The processes and the `trainer.strategy` (a class_path and init_args, or "auto") that `layout` runs.

    Args:
        layout: The parsed `layout` option (`MeshLayout`'s fields).

    Returns:
        (D x P x T, "auto" or Namespace(class_path=..., init_args=Namespace(...))).

    Raises:
        ValueError: A degree that is not an integer of at least 1; an option of a way the layout lacks, naming it;
            `overlap` with a pipeline.
    """
    degrees = {way: layout.get(way) for way in ("data", "pipeline", "tensor")}
    for way, degree in degrees.items():
        if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
            raise ValueError(f"layout.{way} must be an integer of at least 1, got {degree!r}")
    words = degrees_words(*degrees.values())
    given = {name: layout.get(name) for name in (*_OPTION_WAYS, "processes") if layout.get(name) is not None}
    for name, way in _OPTION_WAYS.items():
        if name in given and degrees[way] == 1 and not _neutral(name, given[name]):
            raise ValueError(f"layout.{name} is an option of the {way} dimension, and this layout ({words}) has "
                             f"none: set layout.{way} to 2 or more, or leave {name} out")
    if given.get("overlap") and degrees["pipeline"] > 1:
        raise ValueError(f"layout.overlap exchanges buckets during backward, which the pipeline's schedule runs "
                         f"itself: set layout.pipeline to 1, or leave overlap out ({words})")
    processes = degrees["data"] * degrees["pipeline"] * degrees["tensor"]
    if processes == 1:
        return 1, "auto"
    way = "pipeline" if degrees["pipeline"] > 1 else "tensor" if degrees["tensor"] > 1 else "data"
    class_path, data_arg = _STRATEGIES[way]
    init_args = {data_arg: 1 if way == "data" else degrees["data"], **given}
    if way == "pipeline":
        init_args["tensor"] = degrees["tensor"]
    return processes, Namespace(class_path=class_path, init_args=Namespace(**init_args))


def _neutral(name: str, value: Any) -> bool:
    """Whether a data option's value does nothing (no compression, zero_stage 0, no overlap), so that a preset
    may write it and still run with one copy."""
    kind = value.get("kind") if isinstance(value, Namespace) else getattr(value, "kind", None)
    return (name, kind if name == "compression" else value) in (("compression", "none"), ("zero_stage", 0),
                                                                ("overlap", False))


def apply_layout(layout: Namespace | None, trainer: Namespace) -> None:
    """Set `trainer.devices` and `trainer.strategy` from `layout` (nothing without one), in the parsed config.

    A strategy the config names already is kept when it is the layout's class with the layout's degrees (the
    config.yaml of a run made from a layout names both), the layout's options written over its own; otherwise the
    two disagree and the run is refused.

    Raises:
        ValueError: What `strategy_for_layout` refuses; `trainer.devices` other than 1, auto or the layout's
            processes per node; processes that `trainer.num_nodes` does not divide; `trainer.strategy` naming
            another strategy or other degrees.
    """
    if layout is None:
        return
    processes, strategy = strategy_for_layout(layout)
    words = f"layout {degrees_words(layout.data, layout.pipeline, layout.tensor)} ({processes} processes)"
    nodes = trainer.get("num_nodes") or 1
    if processes % nodes:
        raise ValueError(f"{words} does not divide over trainer.num_nodes {nodes}: give a layout whose processes "
                         "are a multiple of the nodes")
    trainer.strategy = _agreed(trainer.get("strategy"), strategy, words)
    if trainer.get("devices") not in (1, "1", "auto", processes // nodes):
        raise ValueError(f"trainer.devices {trainer.devices} and {words} disagree: leave trainer.devices out, the "
                         "layout sets it (--trainer.devices auto when a config names it)")
    trainer.devices = processes // nodes


def _agreed(configured: Any, strategy: Any, words: str) -> Any:
    """The strategy to run: the layout's, merged into a configured one of the same class and degrees.

    Raises:
        ValueError: A configured strategy of another class or other degrees.
    """
    if configured in (None, "auto"):
        return strategy
    if isinstance(configured, Namespace) and isinstance(strategy, Namespace) \
            and configured.get("class_path") == strategy.class_path:
        init_args = configured.get("init_args") or Namespace()
        degrees = [k for k in ("replicas_per_process", "replicas", "pipelines", "tensor") if k in strategy.init_args]
        if all(init_args.get(k, 1) == strategy.init_args[k] for k in degrees):
            return Namespace(class_path=strategy.class_path, init_args=Namespace(**{**vars(init_args),
                                                                                    **vars(strategy.init_args)}))
    name = configured.get("class_path") if isinstance(configured, Namespace) else configured
    raise ValueError(f"trainer.strategy ({name}, with its own degrees) and {words} both say how the run is split, and "
                     "they disagree: give the degrees once, in layout (adding --trainer.strategy auto "
                     "--trainer.devices auto when a config names them, as a run's config.yaml does), or leave layout "
                     "out")
