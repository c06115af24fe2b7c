"""The three ways' predictions next to measured steps: `compare_with_measured` reads the rows that
benchmarks/three_ways.py writes (benchmarks/three_ways.json) and predicts each of them, process by process.

The file's shape (one row per measured layout; bytes per process, counted from the local tensors, the resident set
and the TCP counters):

    {"date": ..., "hardware": ..., "torch": ..., "rows": [
      {"model": "lenet" | "resnet18", "way": "one_device" | "one_core" | "data" | "pipeline" | "tensor_parallel",
       "schedule": "gpipe" | "1f1b" | null, "processes": 2, "batch": 128, "microbatches": 4 | null,
       "cuts": ["features.3"] | null, "precision": "32-true", "optimizer": "sgd_momentum",
       "per_rank": [{"rank": 0, "parameters": ..., "gradients": ..., "optimizer_state": ..., "activation_peak": ...,
                     "bytes_sent_per_step": ..., "idle_fraction": ... | null}, ...],
       "step_ms": ..., "step_ratio": ..., "step_ratio_one_core": ..., "bubble": ... | null}]}

`batch` is the global batch: every process of a pipeline or of a tensor-parallel group sees all of it, data
parallelism splits it. A row's `cuts` of null is the forecast's own auto cut (the strategy's `auto` balances the
blocks' multiply-adds and may cut elsewhere: give the cut it chose).
"""

import json
from dataclasses import replace
from pathlib import Path

from src.scaling.sources import DEFAULT_CALIBRATION
from src.scaling.three_ways import Layout, LayoutFigures, predict_layout

#: each measured model's experiment config
MODEL_CONFIGS = {"lenet": "configs/lenet.yaml", "resnet18": "configs/resnet18.yaml"}
#: the ZeRO paper's bytes per element for a Lightning precision (autocast keeps float32 weights and gradients)
_MEMORY_PRECISION = {"32-true": "fp32", "64-true": "fp64", "bf16-mixed": "fp32", "16-mixed": "fp32"}
#: how close a prediction is expected to be: a relative error bound (0: exact), or (low, high) bounds of predicted /
#: measured; None: reported only. `WAY_TOLERANCES` overrides it for one way, `ABSOLUTE` bounds a share's difference
#: instead. benchmarks/three_ways.json of 2026-11-29 on the 2-core CPU, the compute from the one-core row, a
#: pipeline's split by timed block costs (the fastest of 7 steps, timed anew in each process, so the pipelines'
#: figures move from run to run; 4 runs on that CPU): model state exact, bytes sent within 0.9%, the rise predicted at
#: 0.47-1.00 of the measured (temporaries are not counted); the step of data parallelism -13% (LeNet) and +3%
#: (ResNet-18), of the pipelines +0% to +9% and -6% to +1%; tensor parallelism's 0.59 and 0.79 of the measured
#: (DTensor's dispatch and copies are not counted: a lower bound); the stages' mean idle share 0.40-0.44 against
#: 0.29-0.32 (LeNet) and 0.33-0.36 against 0.26-0.27 (ResNet-18). Each stage's idle share is reported only: LeNet's
#: recorded stages idle alike (0.30 and 0.29 under GPipe), the timed blocks give its first stage 0.65-0.78 idle.
TOLERANCES = {"parameters": 0, "gradients": 0, "optimizer_state": 0, "bytes_sent_per_step": 0.02,
              "activation_peak": (0.45, 1.05), "idle_fraction": None, "step_ms": 0.25, "step_vs_one_core": 0.25,
              "mean_idle": 0.2, "bubble": 1e-9}
WAY_TOLERANCES = {("tensor_parallel", "step_ms"): (0.5, 1.05), ("tensor_parallel", "step_vs_one_core"): (0.5, 1.05)}
ABSOLUTE = {"mean_idle"}
_PER_RANK = ("parameters", "gradients", "optimizer_state", "activation_peak", "bytes_sent_per_step", "idle_fraction")


def load_measured(path: str | Path) -> dict:
    """The measured file, checked for the fields `compare_with_measured` reads.

    Args:
        path: benchmarks/three_ways.json or a file of its shape.

    Returns:
        Its content.

    Raises:
        ValueError: A missing file, or a row without a field it needs (the message names the row and the field).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"measured file {path} not found: run benchmarks/three_ways.py to write it")
    data = json.loads(path.read_text())
    need = ("model", "way", "processes", "batch", "per_rank", "step_ms")
    for i, row in enumerate(data.get("rows", [])):
        missing = [k for k in need if k not in row]
        if missing:
            raise ValueError(f"{path}: row {i} lacks {', '.join(missing)}")
        if row["model"] not in MODEL_CONFIGS:
            raise ValueError(f"{path}: row {i} has model {row['model']!r}; known: {', '.join(MODEL_CONFIGS)}")
    return data


def _layout(row: dict, profile: object) -> Layout:
    """The layout a measured row ran."""
    from src.strategies.pipeline_stages import cut_starts

    way, p = row["way"], int(row["processes"])
    if way in ("one_device", "one_core"):
        return Layout("data", 1)
    if way == "data":
        return Layout("data", p, 1, int(row.get("zero_stage") or 0))
    if way == "pipeline":
        cuts = row.get("cuts")
        starts = None if not cuts else tuple(cut_starts([(n, None) for n in profile.names], cuts, len(cuts) + 1))
        return Layout("pipeline", p, 1, 0, row.get("schedule") or "gpipe", int(row.get("microbatches") or 1), starts)
    if way == "tensor_parallel":
        return Layout("tensor_parallel", p)
    raise ValueError(f"unknown way {way!r} in a measured row; known: one_device, one_core, data, pipeline, "
                     "tensor_parallel")


def predict_row(row: dict, hardware: str = "cpu-2core", calibration: str = DEFAULT_CALIBRATION,
                link_rate: str | None = None, block_costs: tuple[float, ...] | None = None,
                **overrides: float | None) -> tuple[LayoutFigures, LayoutFigures]:
    """Predict a measured row's layout and one device's step at the same global batch.

    Args:
        row: One row of the measured file.
        hardware: The forecast's hardware preset the row ran on (`--hardware`).
        calibration: The calibration file (`--calibration`).
        link_rate: The lab's link rate in tc's notation, e.g. 1gbit (`--link_rate`), or None.
        block_costs: Each block's cost that splits a pipeline's compute (`Setting.block_costs`); None: the
            multiply-adds.
        **overrides: More of the forecast's overrides (`src.scaling.sources.Overrides`), e.g. a measured
            `seconds_per_image` and `overhead_s` of one process's step.

    Returns:
        (the row's layout predicted, one device predicted).

    Raises:
        ValueError: An unknown way, model, precision or optimizer, or a layout the network cannot take.
    """
    from src.scaling.layer_profile import profile_network
    from src.scaling.predictor import Paths, Question, _experiment, predict
    from src.scaling.sources import Overrides

    config = MODEL_CONFIGS[row["model"]]
    precision = row.get("precision") or "32-true"
    if precision not in _MEMORY_PRECISION:
        raise ValueError(f"unknown precision {precision!r} in a measured row; known: {', '.join(_MEMORY_PRECISION)}")
    batch = int(row["batch"])
    question = Question(config=config, hardware=hardware, devices=[1], algorithms=["ring"], batch_mode="global",
                        batch_size=batch, optimizer=row.get("optimizer"), memory_precision=_MEMORY_PRECISION[precision])
    setting = predict(question, Overrides(link_rate=link_rate, **overrides), Paths(calibration=calibration)).setting
    setting = replace(setting, activation_bytes=8 if precision == "64-true" else 4, block_costs=block_costs)
    model = _experiment(config)["model"]
    profile = profile_network(model["class_path"], model.get("init_args"))
    return (predict_layout(profile, _layout(row, profile), batch, setting),
            predict_layout(profile, Layout("data", 1), batch, setting))


def _entry(index: int, row: dict, rank: int | None, quantity: str, predicted: float | None,
           measured: float | None, held: bool = True) -> dict:
    error = None if predicted is None or not measured else (predicted - measured) / measured
    bound = WAY_TOLERANCES.get((row["way"], quantity), TOLERANCES.get(quantity)) if held else None
    if error is None or bound is None:
        within = None
    elif quantity in ABSOLUTE:
        within = abs(predicted - measured) <= bound
    elif isinstance(bound, tuple):
        within = bound[0] <= predicted / measured <= bound[1]
    else:
        within = abs(error) <= bound
    return {"row": index, "model": row["model"], "way": row["way"], "schedule": row.get("schedule"),
            "processes": row["processes"], "batch": row["batch"], "microbatches": row.get("microbatches"),
            "rank": rank, "quantity": quantity, "predicted": predicted, "measured": measured,
            "relative_error": error, "within": within}


def _predicted(row: dict, rank: object, quantity: str) -> float | None:
    """The prediction that a measured per-process figure is compared with. The measured `activation_peak` is the
    rise of the resident set within a step: the saved activations and, in a pipeline, the stage's gradients too,
    since the schedule's backward runs inside the training step, before Lightning lets the previous step's
    gradients go (`PipelineStrategy.training_step` holds them apart), so both are held at once. Temporaries
    (activation gradients, the exchange's buffers) are not predicted: the prediction is expected below the rise."""
    value = getattr(rank, quantity)
    if quantity == "activation_peak" and row["way"] == "pipeline":
        value += rank.gradients
    return value


def _one_core_compute(rows: list[dict], row: dict, hardware: str, calibration: str) -> dict:
    """The compute of one process measured in the same run, as the forecast's overrides: the model's `one_core` row
    (one process of one thread, the forecast's device on this CPU) gives the seconds per image, the calibration the
    fixed overhead. Empty when the file has no such row."""
    from src.scaling.predictor import Paths, Question, predict
    from src.scaling.sources import Overrides

    core = next((r for r in rows if r["model"] == row["model"] and r["way"] == "one_core"), None)
    if core is None:
        return {}
    question = Question(config=MODEL_CONFIGS[row["model"]], hardware=hardware, devices=[1], algorithms=["ring"],
                        batch_mode="global", batch_size=int(core["batch"]), optimizer=core.get("optimizer"))
    overhead = predict(question, Overrides(), Paths(calibration=calibration)).setting.compute.overhead_s
    return {"overhead_s": overhead, "seconds_per_image": (core["step_ms"] / 1e3 - overhead) / int(core["batch"])}


def _timed_costs(row: dict) -> tuple[float, ...]:
    """Each block's forward and backward timed here at one thread, on a micro-batch of the row's pipeline (or
    half its batch)."""
    from src.scaling.block_timing import timed_block_costs
    from src.scaling.predictor import _experiment

    model = _experiment(MODEL_CONFIGS[row["model"]])["model"]
    samples = int(row["batch"]) // int(row.get("microbatches") or 2)
    return timed_block_costs(model["class_path"], model.get("init_args"), samples=max(1, samples))


def compare_with_measured(path: str | Path, hardware: str = "cpu-2core", calibration: str = DEFAULT_CALIBRATION,
                          link_rate: str | None = None, block_costs: str = "macs") -> list[dict]:
    """Every measured figure of benchmarks/three_ways.json next to its prediction.

    Where the file has a `one_core` row of a model (one process of one thread), its step calibrates the compute of
    that model's predictions (`_one_core_compute`), so the step figures test the forecast's split of the work and
    its waits, not the calibration file; that row's own step is then reported, not held. So is the `one_device`
    row's (one process on both cores' threads: not the forecast's device, which is one core).

    Args:
        path: The measured file (shape in this module's docstring).
        hardware: The forecast's hardware preset the rows ran on.
        calibration: The calibration file.
        link_rate: The lab's link rate (tc's notation) the rows ran at, or None.
        block_costs: What splits a pipeline's compute between its stages: "macs" (multiply-adds) or "timed" (each
            block's forward and backward timed on this machine, `src.scaling.block_timing`).

    Returns:
        One dict per (row, rank, quantity) and per (row, quantity) of the step: row (its index), model, way,
        schedule, processes, batch, microbatches, rank (None for the step's figures), quantity (parameters,
        gradients, optimizer_state, activation_peak, bytes_sent_per_step, idle_fraction; step_ms,
        step_vs_one_core, bubble, and mean_idle over a pipeline's stages when the row recorded their idle shares),
        predicted, measured, relative_error ((predicted - measured) / measured; None when either is missing or
        measured is 0) and within (whether it lies inside `TOLERANCES`, `WAY_TOLERANCES` or, for the shares of
        `ABSOLUTE`, within that difference; None when no tolerance is set, the figure is not held or no error could
        be computed). Bytes, milliseconds and shares as in the file.

    Raises:
        ValueError: As `load_measured` and `predict_row`, or block_costs neither macs nor timed.
    """
    if block_costs not in ("macs", "timed"):
        raise ValueError(f"block_costs must be macs or timed, got {block_costs!r}")
    out = []
    rows = load_measured(path).get("rows", [])
    for i, row in enumerate(rows):
        compute = _one_core_compute(rows, row, hardware, calibration)
        costs = _timed_costs(row) if block_costs == "timed" and row["way"] == "pipeline" else None
        figures, one = predict_row(row, hardware, calibration, link_rate, costs, **compute)
        ranks = {r.rank: r for r in figures.ranks}
        for measured in row["per_rank"]:
            rank = ranks.get(int(measured["rank"]))
            for q in _PER_RANK:
                out.append(_entry(i, row, measured["rank"], q, None if rank is None else _predicted(row, rank, q),
                                  measured.get(q)))
        held = not row["way"].startswith("one_") or not compute
        out += [_entry(i, row, None, "step_ms", figures.step_s * 1e3, row.get("step_ms"), held),
                _entry(i, row, None, "step_vs_one_core", figures.step_s / one.step_s, row.get("step_ratio_one_core"),
                       held),
                _entry(i, row, None, "bubble", figures.bubble, row.get("bubble"))]
        idle = [r.get("idle_fraction") for r in row["per_rank"]]
        if row["way"] == "pipeline" and idle and None not in idle:
            out.append(_entry(i, row, None, "mean_idle", sum(r.idle_fraction for r in figures.ranks) / len(ranks),
                              sum(idle) / len(idle)))
    return out
