"""Calibrate the scaling predictor on this machine: allreduce alpha / beta over gloo on loopback, and compute time.

    python -m src.forecast --calibrate              # rewrites the shipped src/scaling/calibration/cpu-2core.json
    python -m src.forecast --calibrate --calibrate_processes "[2]" --calibration /tmp/cal.json

1. Allreduce (`measure_allreduce`, `fit_allreduce`): ring's 2(P-1)·alpha + 2(P-1)/P·n·beta fitted on relative
   error to each implementation's timings; the sizes the allreduce check judges (`CHECK_SIZES`) are timed and kept
   but left out of the fit, so that the check tests sizes the fit has not seen.
2. Compute (`measure_compute`): overhead + batch·seconds_per_image fitted to the real Trainer's step times.

Takes a few minutes and loads every core: nothing else should run meanwhile.
"""

import datetime
import json
import os
import platform
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import yaml

from src.scaling.cost_fit import fit_alpha_beta, fit_line, relative_errors
from src.scaling.layer_profile import built_module
from src.scaling.sources import load_calibration

# Batch sizes timed per network, small enough for a single-thread CPU to take seconds, spanning a
# replica's share of the shipped global batches.
BATCHES = {"LeNetClassifier": [32, 128, 256], "ResNet18Classifier": [8, 16, 32]}
DEFAULT_BATCHES = [16, 64]
# the sizes `python -m benchmarks.forecast_checks allreduce` judges the fit at: timed, but left out of the fit
CHECK_SIZES = {65_536: "64 KiB", 516_272: "LeNet", 44_684_072: "ResNet-18"}
# entries measured in the lab (`write_lab_links`), not by `calibrate`
LAB_KEYS = ("lab_ring", "lab_torch")


def _fit_summary(errors: list[float]) -> dict:
    """Root-mean-square and largest absolute relative error."""
    return {"rms_rel_err": (sum(e * e for e in errors) / len(errors)) ** 0.5, "max_rel_err": max(map(abs, errors))}


def _fit_link(rows: list[list], what: str, tail: str) -> tuple[dict, list[float]]:
    """Alpha and beta fitted to `rows` ([p, bytes, seconds]) on relative error, printed with `tail`: the entry's
    first keys, and the relative errors."""
    alpha, beta = fit_alpha_beta(rows)
    errors = relative_errors(rows, alpha, beta)
    entry = {"what": what, "alpha_s": alpha, "beta_s_per_byte": beta, "bandwidth_GB_s": 1e-9 / beta,
             "fit": _fit_summary(errors)}
    print(f"fit {what}: alpha {alpha * 1e6:.1f} us, {1e-9 / beta:.2f} GB/s, relative error rms "
          f"{entry['fit']['rms_rel_err']:.0%} {tail}", flush=True)
    return entry, errors


def fit_allreduce(samples: list[list], what: str) -> dict:
    """Alpha and beta of one implementation, fitted on the samples whose size is not one of `CHECK_SIZES`.

    Args:
        samples: [p, bytes, seconds] per timing, every size (the held-out ones are kept in the result).
        what: The implementation, for the file and the printed line.

    Returns:
        {"what", "alpha_s", "beta_s_per_byte", "bandwidth_GB_s", "fit" (relative errors on the fitted samples,
        overall and per P), "held_out_sizes", "samples"}.

    Raises:
        ValueError: Too few samples outside the check sizes.
    """
    fitted = [s for s in samples if s[1] not in CHECK_SIZES]
    result, errors = _fit_link(fitted, what, f"on {len(fitted)} samples (check sizes held out)")
    result["fit"]["per_p"] = {str(p): _fit_summary([e for (q, _, _), e in zip(fitted, errors) if q == p])
                              for p in sorted({s[0] for s in fitted})}
    return {**result, "held_out_sizes": sorted(CHECK_SIZES), "samples": samples}


def measure_allreduce(processes: list[int], repeats: int) -> list[dict]:
    """Median seconds of both allreduce implementations (`src.scaling.allreduce_timing`) for every size of its
    sweep and every P.

    Args:
        processes: Process counts P, each >= 2.
        repeats: Timed calls per size and implementation.

    Returns:
        Rows {"p", "bytes", "ring", "torch"} (bytes; seconds).

    Raises:
        torch.multiprocessing.ProcessRaisedException: A timing process failed.
    """
    from src.scaling.allreduce_timing import time_allreduces

    rows = []
    for world in processes:
        for row in time_allreduces(world, repeats):
            rows.append({"p": world, "bytes": row["size"], "ring": row["ring"], "torch": row["torch"]})
            print(f"allreduce P={world} {row['size']:>10,} bytes: ring {row['ring'] * 1e3:8.3f} ms, "
                  f"dist.all_reduce {row['torch'] * 1e3:8.3f} ms", flush=True)
    return rows


def _timed_steps(class_path: str, init_args: dict, batch: int, steps: int, root: str) -> list[float]:
    """Seconds between consecutive training-batch ends (data, forward, backward, optimizer, hooks) of `steps`
    steps, the first two dropped."""
    import lightning.pytorch as pl

    from src.data.fashion_mnist import FashionMNISTDataModule

    class Intervals(pl.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.ends.append(time.perf_counter())

    timer = Intervals()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, limit_val_batches=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[timer])
    trainer.fit(built_module(class_path, init_args),
                FashionMNISTDataModule(root, batch_size=batch, val_size=100, download=False))
    return [b - a for a, b in zip(timer.ends, timer.ends[1:])][2:]


def measure_compute(configs: list[str], steps: int = 10, rounds: int = 2) -> dict:
    """Per-network line overhead + batch·seconds_per_image from timed training steps on one thread (as each of
    DDP's processes gets on a 2-core CPU), on synthetic IDX files (`src.data.synthetic`) in a temporary folder:
    the arithmetic of a step does not depend on the pixels.

    Args:
        configs: Experiment configs (their model.class_path and init_args are built).
        steps: Training steps per timed run (the first two intervals are dropped).
        rounds: Runs per batch size, alternated across sizes.

    Returns:
        {class name: {"overhead_s" (seconds), "seconds_per_image", "threads", "samples": [[batch, median
        seconds], ...], "fit": {"rms_rel_err", "max_rel_err"}, "config"}}.

    Raises:
        OSError: A config cannot be read.
        KeyError: A config has no model.
    """
    import torch

    from src.data.synthetic import write_fashion_mnist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="fmnist-calibrate-")
    write_fashion_mnist(Path(root) / "FashionMNIST" / "raw", n_train=100 + 256 * (steps + 2), n_test=100)
    result = {}
    for config in configs:
        model = (yaml.safe_load(Path(config).read_text()) or {})["model"]
        cls_name = model["class_path"].rpartition(".")[2]
        times: dict[int, list[float]] = {b: [] for b in BATCHES.get(cls_name, DEFAULT_BATCHES)}
        for _ in range(rounds):  # alternate the batch sizes: the machine drifts between minutes
            for b in times:
                times[b] += _timed_steps(model["class_path"], model.get("init_args") or {}, b, steps, root)
        samples = [[b, statistics.median(t)] for b, t in times.items()]
        overhead, per_image = fit_line([(b, t) for b, t in samples])
        errors = [(overhead + b * per_image - t) / t for b, t in samples]
        result[cls_name] = {"config": config, "overhead_s": overhead, "seconds_per_image": per_image,
                            "threads": 1, "samples": samples, "fit": _fit_summary(errors)}
        print(f"compute {cls_name}: {overhead * 1e3:.2f} ms/step + {per_image * 1e6:.1f} us/image "
              f"(samples {[(b, round(t * 1e3, 2)) for b, t in samples]} ms)", flush=True)
    return result


def calibrate(path: str, configs: list[str], processes: list[int], repeats: int) -> Path:
    """Measure, fit and write the calibration file `path` (its lab links, `LAB_KEYS`, kept).

    Args:
        path: File to write; its folder is created if needed. `python -m src.forecast --calibrate` passes the
            shipped `src/scaling/calibration/cpu-2core.json` unless --calibration names another.
        configs: Experiment configs whose networks' compute is timed.
        processes: Process counts P of the allreduce timings, each >= 2.
        repeats: Timed calls per allreduce size.

    Returns:
        The file written.

    Raises:
        ValueError: Too few allreduce samples to fit alpha and beta.
        OSError: The file cannot be written.
    """
    import torch

    date = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    started = time.perf_counter()
    rows = measure_allreduce(processes, repeats)
    allreduce = {key: fit_allreduce([[r["p"], r["bytes"], r[key]] for r in rows], what) for key, what in (
        ("torch", "dist.all_reduce (gloo)"), ("ring", "our point-to-point ring (gloo)"))}
    compute = measure_compute(configs)
    machine = platform.machine().replace("_", "-")
    cal = {
        "date": date,
        "hardware": f"{os.cpu_count()}-core {machine} CPU, gloo over loopback, torch {torch.__version__.split('+')[0]}",
        "command": "python -m src.forecast --calibrate",
        "method": "allreduce: median of the src.scaling.allreduce_timing timing, fitted on relative error with the "
                  "ring model; compute: a line through the median step times at several batches, one thread",
        "repeats": repeats,
        "seconds_taken": round(time.perf_counter() - started, 1),
        "allreduce": {**_lab_links(path), **allreduce},
        "compute": compute,
    }
    out = _write(path, cal)
    print(f"calibration: {out} ({cal['seconds_taken']:.0f} s)")
    return out


def _lab_links(path: str) -> dict:
    """The lab's entries (`LAB_KEYS`) of the calibration file at `path`, if any, which a rewrite keeps."""
    try:
        old = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in old.get("allreduce", {}).items() if k in LAB_KEYS}


def _write(path: str, cal: dict) -> Path:
    """Write `cal` to `path` through a temporary name, then rename (a reader never sees half a file)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(cal, indent=1) + "\n")
    os.replace(tmp, out)
    return out


def write_lab_links(path: str, samples: dict[str, list[list]], hardware: str, command: str) -> Path:
    """Fit the lab's links from allreduce timings between emulated machines and store them in the calibration
    file at `path` (its other entries are kept).

    The lab's machines are network namespaces of one host: unshaped, their link costs what the CPU spends
    moving and adding the bytes (the kernel's copies through the bridge, gloo's and our buffers), which a
    shaped link adds its wire time to (`src.scaling.hardware.shaped`).

    Args:
        path: The calibration file (it must exist: run `python -m src.forecast --calibrate` first).
        samples: "ring" (ours) and / or "torch" (`dist.all_reduce`) -> [P, bytes, seconds] timings over an
            unshaped lab link, every size fitted (alpha, beta) on relative error with the ring model.
        hardware: The host, for the entry (e.g. "2-core AMD EPYC, 2 machines of 1 core").
        command: The command that measured them.

    Returns:
        The file written.

    Raises:
        ValueError: The file does not exist, an unknown key, or too few sizes to fit.
    """
    cal = load_calibration(path)
    date = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    for key, rows in samples.items():
        if key not in ("ring", "torch"):
            raise ValueError(f"unknown implementation {key!r}: give ring or torch timings")
        what = ("our point-to-point ring" if key == "ring" else "dist.all_reduce") + " between unshaped lab machines"
        entry = _fit_link(rows, what, f"over {len(rows)} timings")[0]
        cal.setdefault("allreduce", {})[f"lab_{key}"] = {**entry, "date": date, "hardware": hardware,
                                                         "command": command, "samples": rows}
    return _write(path, cal)
