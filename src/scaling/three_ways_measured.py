"""The three ways' predictions next to measured steps: `compare_with_measured` reads the rows that
benchmarks/three_ways.py writes (benchmarks/three_ways.json) and predicts each of them, process by process.

The file's shape (one row per measured layout; bytes per process, counted from the local tensors, the resident set
and the TCP counters):

    {"date": ..., "hardware": ..., "torch": ..., "rows": [
      {"model": "lenet" | "resnet18", "way": "one_device" | "data" | "pipeline" | "tensor_parallel",
       "schedule": "gpipe" | "1f1b" | null, "processes": 2, "batch": 128, "microbatches": 4 | null,
       "cuts": ["features.3"] | null, "precision": "32-true", "optimizer": "sgd_momentum",
       "per_rank": [{"rank": 0, "parameters": ..., "gradients": ..., "optimizer_state": ..., "activation_peak": ...,
                     "bytes_sent_per_step": ..., "idle_fraction": ... | null}, ...],
       "step_ms": ..., "step_ratio": ..., "bubble": ... | null}]}

`batch` is the global batch: every process of a pipeline or of a tensor-parallel group sees all of it, data
parallelism splits it. A row's `cuts` of null is the forecast's own auto cut (the strategy's `auto` times the blocks
and may cut elsewhere: give the cut it chose).
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
#: how close a prediction is expected to be: relative error bounds, or (low, high) bounds of predicted / measured;
#: None: reported only
# (benchmarks/three_ways.json of 2026-11-29 on the 2-core CPU: model state exact, bytes sent within 1.5%, the rise
# predicted at 0.49-1.01 of the measured one, ResNet-18's 0.68-1.01; step and idle figures are off by up to 51%
# and 3x: the compute of each stage or share is split by multiply-adds, and the 1-thread calibration is set
# against one device on 2 threads, so they are reported, not held to a bound)
TOLERANCES = {"parameters": 0.01, "gradients": 0.01, "optimizer_state": 0.01, "bytes_sent_per_step": 0.02,
              "activation_peak": (0.45, 1.05), "idle_fraction": None, "step_ms": None, "step_ratio": None,
              "bubble": 1e-9}
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
    if way == "one_device":
        return Layout("data", 1)
    if way == "data":
        return Layout("data", p, 1, int(row.get("zero_stage") or 0))
    if way == "pipeline":
        cuts = row.get("cuts")
        starts = None if not cuts else tuple(cut_starts([(n, None) for n in profile.names], cuts, len(cuts) + 1))
        return Layout("pipeline", p, 1, 0, row.get("schedule") or "gpipe", int(row.get("microbatches") or 1), starts)
    if way == "tensor_parallel":
        return Layout("tensor_parallel", p)
    raise ValueError(f"unknown way {way!r} in a measured row; known: one_device, data, pipeline, tensor_parallel")


def predict_row(row: dict, hardware: str = "cpu-2core", calibration: str = DEFAULT_CALIBRATION,
                link_rate: str | None = None, **overrides: float | None) -> tuple[LayoutFigures, LayoutFigures]:
    """Predict a measured row's layout and one device's step at the same global batch.

    Args:
        row: One row of the measured file.
        hardware: The forecast's hardware preset the row ran on (`--hardware`).
        calibration: The calibration file (`--calibration`).
        link_rate: The lab's link rate in tc's notation, e.g. 1gbit (`--link_rate`), or None.
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
    setting = replace(setting, activation_bytes=8 if precision == "64-true" else 4)
    model = _experiment(config)["model"]
    profile = profile_network(model["class_path"], model.get("init_args"))
    return (predict_layout(profile, _layout(row, profile), batch, setting),
            predict_layout(profile, Layout("data", 1), batch, setting))


def _entry(index: int, row: dict, rank: int | None, quantity: str, predicted: float | None,
           measured: float | None) -> dict:
    error = None if predicted is None or not measured else (predicted - measured) / measured
    bound = TOLERANCES.get(quantity)
    if error is None or bound is None:
        within = None
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


def compare_with_measured(path: str | Path, hardware: str = "cpu-2core", calibration: str = DEFAULT_CALIBRATION,
                          link_rate: str | None = None) -> list[dict]:
    """Every measured figure of benchmarks/three_ways.json next to its prediction.

    Args:
        path: The measured file (shape in this module's docstring).
        hardware: The forecast's hardware preset the rows ran on.
        calibration: The calibration file.
        link_rate: The lab's link rate (tc's notation) the rows ran at, or None.

    Returns:
        One dict per (row, rank, quantity) and per (row, quantity) of the step: row (its index), model, way,
        schedule, processes, batch, microbatches, rank (None for the step's figures), quantity (parameters,
        gradients, optimizer_state, activation_peak, bytes_sent_per_step, idle_fraction; step_ms, step_ratio,
        bubble), predicted, measured, relative_error ((predicted - measured) / measured; None when either is
        missing or measured is 0) and within (whether it lies inside `TOLERANCES`; None when no tolerance is set
        or no error could be computed). Bytes, milliseconds and shares as in the file.

    Raises:
        ValueError: As `load_measured` and `predict_row`.
    """
    out = []
    for i, row in enumerate(load_measured(path).get("rows", [])):
        figures, one = predict_row(row, hardware, calibration, link_rate)
        ranks = {r.rank: r for r in figures.ranks}
        for measured in row["per_rank"]:
            rank = ranks.get(int(measured["rank"]))
            for q in _PER_RANK:
                out.append(_entry(i, row, measured["rank"], q, None if rank is None else _predicted(row, rank, q),
                                  measured.get(q)))
        out += [_entry(i, row, None, "step_ms", figures.step_s * 1e3, row.get("step_ms")),
                _entry(i, row, None, "step_ratio", figures.step_s / one.step_s, row.get("step_ratio")),
                _entry(i, row, None, "bubble", figures.bubble, row.get("bubble"))]
    return out
