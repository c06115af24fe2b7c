"""Test accuracy of the main job's 10 LeNet epochs under gradient compression, per seed.

    python -m benchmarks.compression_accuracy --layouts "ours,ours powersgd r2" --seeds 0,1,2 --json acc.json

Every trial is `python -m src.cli fit --config configs/lenet.yaml --config <overlay> --seed_everything S` on 2 CPU
processes (the shipped overlays: `split_allreduce_processes.yaml`, `split_allreduce_bf16.yaml`,
`split_allreduce_powersgd.yaml` and DDP's `ddp_cpu*.yaml`, PowerSGD after its 1000 exact warm-up steps), and its
figure is the "test acc" line the CLI prints (the best checkpoint on the 10,000 test images). Results are appended
to `--json` as they come, so an interrupted series keeps what it measured; layouts and seeds already there are
skipped.
"""

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

OVERLAYS = {"ours": "split_allreduce_processes", "ours bf16": "split_allreduce_bf16",
            "ours powersgd r1": "split_allreduce_powersgd", "ours powersgd r2": "split_allreduce_powersgd",
            "ours powersgd r4": "split_allreduce_powersgd", "ddp": "ddp_cpu", "ddp bf16": "ddp_cpu_bf16",
            "ddp powersgd r2": "ddp_cpu_powersgd"}


def trial(layout: str, seed: int, out: Path) -> float:
    """The test accuracy of one 10-epoch run."""
    rank = ["--trainer.strategy.init_args.compression.rank", layout[-1]] if "powersgd" in layout else []
    cmd = [sys.executable, "-m", "src.cli", "fit", "--config", "configs/lenet.yaml", "--config",
           f"configs/strategy/{OVERLAYS[layout]}.yaml", *rank, "--seed_everything", str(seed),
           "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    found = re.search(r"^test acc ([0-9.]+)", done.stdout + done.stderr, re.MULTILINE)
    if done.returncode or not found:
        raise SystemExit(f"{layout} seed {seed} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return float(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="ours,ours powersgd r2",
                        help=f"comma-separated, of: {', '.join(OVERLAYS)}")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--json", type=Path, required=True, help="results, appended as they come")
    args = parser.parse_args()
    results = json.loads(args.json.read_text()) if args.json.exists() else {}
    for layout in args.layouts.split(","):
        if layout not in OVERLAYS:
            raise SystemExit(f"unknown layout {layout!r}; choose from {', '.join(OVERLAYS)}")
        for seed in args.seeds.split(","):
            if seed in results.get(layout, {}):
                continue
            with tempfile.TemporaryDirectory() as tmp:
                acc = trial(layout, int(seed), Path(tmp))
            results.setdefault(layout, {})[seed] = acc
            args.json.write_text(json.dumps(results, indent=1))
            print(f"{layout} seed {seed}: test acc {acc:.4f}", flush=True)
    print("\n| layout | seeds | test acc per seed | mean | vs uncompressed (same strategy) |\n|---|---|---|---|---|")
    for layout, by_seed in results.items():
        mean = statistics.mean(by_seed.values())
        base = results.get(layout.split()[0])
        delta = f"{mean - statistics.mean(base.values()):+.4f}" if base and layout != layout.split()[0] else "-"
        print(f"| {layout} | {', '.join(by_seed)} | {', '.join(f'{a:.4f}' for a in by_seed.values())} | "
              f"{mean:.4f} | {delta} |")


if __name__ == "__main__":
    main()
