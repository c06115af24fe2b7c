"""Sweep LeNet recipes (10 epochs each) through the real CLI and print the test accuracy of each.

    python -m benchmarks.tune_lenet                       # CPU, a few minutes per recipe
    python -m benchmarks.tune_lenet --accelerator gpu     # the same recipes on a GPU, seconds each

Each recipe is a list of overrides of configs/lenet.yaml. A GPU sweep only ranks recipes quickly: its
kernels round differently from the CPU's, so confirm the chosen one on the CPU before quoting it.
"""

import argparse
import time
import warnings

from src.cli import main

warnings.filterwarnings("ignore")

M = "--model.init_args."
RECIPES = {
    "current": [],
    "lr0.2": [M + "lr", "0.2"],
    "lr0.05": [M + "lr", "0.05"],
    "augment": ["--data.augment", "true"],
    "no_smoothing": [M + "label_smoothing", "0"],
    "wd1e-3": [M + "weight_decay", "1e-3"],
    "b128": ["--data.batch_size", "128"],
    "b128_lr0.05": ["--data.batch_size", "128", M + "lr", "0.05"],
    "b64_lr0.05": ["--data.batch_size", "64", M + "lr", "0.05"],
    "adamw": [M + "optimizer", "adamw", M + "lr", "3e-3", M + "weight_decay", "0.05"],
    "onecycle0.2": [M + "scheduler", "onecycle", M + "lr", "0.2"],
    "b128_wd1e-3": ["--data.batch_size", "128", M + "weight_decay", "1e-3"],
    "lr0.2_nosmooth": [M + "lr", "0.2", M + "label_smoothing", "0"],
    "lr0.3": [M + "lr", "0.3"],
    "lr0.2_wd1e-4": [M + "lr", "0.2", M + "weight_decay", "1e-4"],
    "b128_lr0.2": ["--data.batch_size", "128", M + "lr", "0.2"],
    "b128_nosmooth": ["--data.batch_size", "128", M + "label_smoothing", "0"],
    "lr0.2_seed1": [M + "lr", "0.2", "--seed_everything", "1"],
    "b64_lr0.05_seed1": ["--data.batch_size", "64", M + "lr", "0.05", "--seed_everything", "1"],
    "b128_lr0.2_seed1": ["--data.batch_size", "128", M + "lr", "0.2", "--seed_everything", "1"],
}


def run_recipe(overrides: list[str], accelerator: str, logs: str) -> tuple[float, float]:
    """Train one recipe; returns (test accuracy of the best val checkpoint, seconds)."""
    tic = time.perf_counter()
    # base_batch_size null: each recipe's lr is the lr it trains at, whatever its batch (not scaled from 64)
    cli = main(["fit", "--config", "configs/lenet.yaml", "--trainer.accelerator", accelerator,
                "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", logs,
                "--model.init_args.base_batch_size", "null", *overrides])
    return float(cli.trainer.callback_metrics["test/acc"]), time.perf_counter() - tic


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--only", nargs="*", help="recipe names to run (default: all)")
    parser.add_argument("--logs", default="logs/tune_lenet")
    args = parser.parse_args()
    results = []
    for name in args.only or RECIPES:
        try:
            acc, seconds = run_recipe(RECIPES[name], args.accelerator, args.logs)
        except FloatingPointError as err:  # a recipe whose loss diverged: record it and go on
            print(f"RESULT {name}: diverged ({err})", flush=True)
            continue
        results.append((acc, name))
        print(f"RESULT {name}: test acc {acc:.4f} ({seconds:.0f} s)", flush=True)
    for acc, name in sorted(results, reverse=True):
        print(f"RANKED {acc:.4f} {name} {' '.join(RECIPES[name])}")
