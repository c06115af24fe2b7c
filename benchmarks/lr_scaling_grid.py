"""Train configs/lenet.yaml over a grid of global batches, run lengths, seeds and thread counts under several lr
scaling rules, in one process through the real CLI, and print each run's final val acc and whether it stayed
finite.

    python -m benchmarks.lr_scaling_grid --rules shipped --batches 32 64 128 256 512 --steps 20 --seeds 0 1 2 3 4
    python -m benchmarks.lr_scaling_grid --rules linear sqrt --batches 512 --steps 300 --seeds 0
    python -m benchmarks.lr_scaling_grid --rules shipped --batches 512 --steps 0     # the full 10 epochs + test

`--steps 0` runs the config's full `max_epochs` and evaluates the best checkpoint on the test set. Every run
appends one JSON line to `--out`; `--table [FILE ...]` prints such lines as the Markdown table of
benchmarks/README.md.
A run whose training loss turns NaN or infinite stops there (`nonfinite_loss: stop`) and is recorded with its
step. In float64 (`--precision 64-true`) a diverging run can grow its weights to 1e60 without a non-finite loss,
so every run also records the largest absolute weight.
"""

import argparse
import json
import math
import re
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch

from src.cli import main

warnings.filterwarnings("ignore")

M = "--model.init_args."
# Each rule sets both keys, so it means the same whatever configs/lenet.yaml ships.
RULES = {
    "shipped": [],
    "linear": [M + "lr_scaling", "linear", M + "max_lr", "null", M + "warmup_max_lr_per_step", "null"],
    "sqrt": [M + "lr_scaling", "sqrt", M + "max_lr", "null", M + "warmup_max_lr_per_step", "null"],
    "linear_cap0.1": [M + "lr_scaling", "linear", M + "max_lr", "0.1", M + "warmup_max_lr_per_step", "null"],
    "sqrt_rate": [M + "lr_scaling", "sqrt", M + "max_lr", "null", M + "warmup_max_lr_per_step", "0.00125"],
    "linear_rate": [M + "lr_scaling", "linear", M + "max_lr", "null", M + "warmup_max_lr_per_step", "0.00125"],
}


def run_one(rule: str, batch: int, accumulate: int, steps: int, seed: int, threads: int, precision: str,
            logs: Path, extra: list[str] = ()) -> dict:
    """Train one configuration of the grid; returns its record (val acc and loss, finiteness, seconds)."""
    args = ["fit", "--config", "configs/lenet.yaml", "--threads", str(threads), "--seed_everything", str(seed),
            "--data.batch_size", str(batch), "--trainer.accumulate_grad_batches", str(accumulate),
            "--trainer.precision", precision, "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--trainer.logger.init_args.save_dir", str(logs),
            "--test_after_fit", "true" if steps == 0 else "false", *RULES[rule], *extra]
    if steps:
        args += ["--trainer.max_steps", str(steps)]
    record = {"rule": rule, "batch": batch, "accumulate": accumulate, "steps": steps or "full", "seed": seed,
              "threads": threads, "precision": precision, **({"extra": " ".join(extra)} if extra else {})}
    tic = time.perf_counter()
    try:
        cli = main(args)
    except FloatingPointError as err:
        step = re.search(r"global step (\d+)", str(err))
        record.update(finite=False, nonfinite_step=int(step.group(1)) if step else None, error=str(err)[:120])
    else:
        trainer = cli.trainer
        metrics = trainer.callback_metrics  # after the test of a full run: the test's metrics only
        weights = [p.detach() for p in cli.model.parameters()]  # a full run's: the best checkpoint's, as tested
        max_abs = max(w.abs().max().item() for w in weights)
        record.update(finite=all(bool(torch.isfinite(w).all()) for w in weights) and math.isfinite(max_abs),
                      max_abs_weight=max_abs, val_acc_best=float(trainer.checkpoint_callback.best_model_score),
                      lr_scaled=cli.model.scaled_lr(), global_step=trainer.global_step)
        if "val/acc" in metrics:
            record.update(val_acc=float(metrics["val/acc"]), val_loss=float(metrics["val/loss"]))
        if "test/acc" in metrics:
            record["test_acc"] = float(metrics["test/acc"])
    record["seconds"] = round(time.perf_counter() - tic, 1)
    return record


def _cell(r: dict) -> str:
    """A run's final val acc, or where its loss stopped being finite."""
    if not r["finite"]:
        return f"**NaN/inf at step {r.get('nonfinite_step')}**"
    acc = r.get("val_acc", r.get("val_acc_best"))
    return f"{acc:.3f}" if acc is not None else "?"


def _number(x: float) -> str:
    return f"{x:.3f}" if abs(x) < 1e4 else f"{x:.3g}"


def table(lines: list[dict]) -> str:
    """The records as a Markdown table: one row per rule, run length, accumulation, threads, precision and batch,
    one column per seed (final val acc), then the largest final val loss, the largest absolute weight and the lr.
    Full runs (steps "full") also give the test acc of the best val checkpoint."""
    seeds = sorted({r["seed"] for r in lines})
    groups: dict[tuple, dict[int, dict]] = {}
    for r in lines:
        key = (r["rule"], r.get("extra", ""), str(r["steps"]), r["accumulate"], r["threads"], r["precision"],
               r["batch"])
        groups.setdefault(key, {})[r["seed"]] = r
    head = ["rule", "steps", "accumulate", "threads", "precision", "global batch", "lr",
            *(f"seed {s}" for s in seeds), "max val loss", "max abs weight", "test acc"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (rule, extra, steps, accumulate, threads, precision, batch), runs in groups.items():
        done = list(runs.values())
        losses = [r["val_loss"] for r in done if "val_loss" in r]
        weights = [r["max_abs_weight"] for r in done if "max_abs_weight" in r]
        lrs = {round(r["lr_scaled"], 4) for r in done if "lr_scaled" in r}
        tests = [f"{r['test_acc']:.4f}" for r in done if "test_acc" in r]
        cells = [f"{rule} {extra}".strip(), steps, str(accumulate), str(threads), precision, str(batch * accumulate),
                 " ".join(map(str, sorted(lrs))) or "—", *(_cell(runs[s]) if s in runs else "" for s in seeds),
                 _number(max(losses)) if losses else "—", f"{max(weights):.3g}" if weights else "—",
                 " ".join(tests) or "—"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rules", nargs="+", default=["shipped"], choices=list(RULES))
    parser.add_argument("--batches", nargs="+", type=int, default=[32, 64, 128, 256, 512])
    parser.add_argument("--accumulate", nargs="+", type=int, default=[1])
    parser.add_argument("--steps", nargs="+", type=int, default=[20], help="max_steps; 0: the config's full epochs")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--threads", nargs="+", type=int, default=[1])
    parser.add_argument("--precision", nargs="+", default=["32-true"])
    parser.add_argument("--extra", action="append", default=[],
                        help="a CLI override for every run, as --extra=--key=value (repeatable)")
    parser.add_argument("--out", default="logs/lr_scaling_grid.jsonl", help="JSON lines, appended")
    parser.add_argument("--table", nargs="*", metavar="JSONL",
                        help="print these files (default: --out) as a Markdown table and exit")
    args = parser.parse_args()
    out = Path(args.out)
    if args.table is not None:
        files = [Path(f) for f in args.table] or [out]
        print(table([json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()]))
        raise SystemExit
    out.parent.mkdir(parents=True, exist_ok=True)
    for rule in args.rules:
        for steps in args.steps:
            for accumulate in args.accumulate:
                for batch in args.batches:
                    for threads in args.threads:
                        for precision in args.precision:
                            for seed in args.seeds:
                                logs = Path(tempfile.mkdtemp(prefix="lr_grid_"))
                                try:
                                    record = run_one(rule, batch, accumulate, steps, seed, threads, precision, logs,
                                                     args.extra)
                                finally:
                                    shutil.rmtree(logs, ignore_errors=True)
                                print("RESULT " + json.dumps(record), flush=True)
                                with out.open("a") as f:
                                    f.write(json.dumps(record) + "\n")
