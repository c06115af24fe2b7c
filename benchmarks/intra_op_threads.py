"""Intra-op threads on a quiet and on a shared CPU: the CLI's own choice against fixed counts, alternated rounds.

    python -m benchmarks.intra_op_threads                 # needs the real data (scripts/get_data.sh)
    python -m benchmarks.intra_op_threads --rounds 5 --steps 200

Every trial is a real `python -m src.cli fit --config configs/lenet.yaml` (one device, global batch 64) for
`--steps` training steps, in a fresh process, with one of these settings:

* quiet, chosen: nothing else running, no OMP_NUM_THREADS: the CLI picks the count (src/run/threads.py);
* quiet, 2 threads: OMP_NUM_THREADS=2, torch's own default on a 2-core machine;
* busy, chosen / busy, 1 thread / busy, 2 threads: the same while one other process spins on a core
  (`python -c "while True: pass"`, started before the trial and stopped after it).

A trial's figure is the images/s of the app's epoch line (training only). Each round runs every setting once, in
turn; the table gives medians, ranges and the ratios of time per image that the goals are about.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

SETTINGS = {
    "quiet, chosen": (False, None), "quiet, 2 threads": (False, "2"),
    "busy, chosen": (True, None), "busy, 1 thread": (True, "1"), "busy, 2 threads": (True, "2"),
}
# the epoch line (src/callbacks/epoch_report.py), "... images/s, single: 1 process x 1 replica (1 data x 1 pipeline x
# 1 tensor) on cpu (2 threads)"
LINE = re.compile(r"epoch 0: .*?([\d,]+) images/s, \w+: .*? on cpu \((\d+) threads?")


def trial(busy: bool, threads: str | None, steps: int) -> tuple[float, int]:
    """One run; returns (images/s, threads the run used)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        if spinner is not None:
            time.sleep(0.5)  # let it take its core before the CLI looks
        with tempfile.TemporaryDirectory() as logs:
            out = subprocess.run([sys.executable, "-m", "src.cli", "fit", "--config", "configs/lenet.yaml",
                                  "--trainer.max_steps", str(steps), "--trainer.limit_val_batches", "0",
                                  "--trainer.num_sanity_val_steps", "0", "--test_after_fit", "false",
                                  "--trainer.enable_progress_bar", "false",
                                  "--trainer.logger.init_args.save_dir", logs],
                                 env=env, capture_output=True, text=True, check=True)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    match = LINE.search(out.stdout + out.stderr)
    if match is None:
        raise RuntimeError(f"no epoch line in the output:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return float(match.group(1).replace(",", "")), int(match.group(2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    rates: dict[str, list[float]] = {name: [] for name in SETTINGS}
    used: dict[str, set[int]] = {name: set() for name in SETTINGS}
    for r in range(args.rounds):
        for name, (busy, threads) in SETTINGS.items():
            rate, n = trial(busy, threads, args.steps)
            rates[name].append(rate)
            used[name].add(n)
        print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:,.0f}" for n, v in rates.items()) + " images/s", flush=True)
    med = {n: statistics.median(v) for n, v in rates.items()}
    print("\n| setting | threads used | images/s, median | range |")
    print("|---|---|---|---|")
    for n, v in rates.items():
        print(f"| {n} | {', '.join(map(str, sorted(used[n])))} | {med[n]:,.0f} | {min(v):,.0f}–{max(v):,.0f} |")
    print(f"\nquiet: chosen takes {med['quiet, 2 threads'] / med['quiet, chosen']:.3f}x the time of 2 threads "
          "(goal <= 1.05)")
    print(f"busy: chosen takes {med['busy, 1 thread'] / med['busy, chosen']:.3f}x the time of 1 thread (goal <= 1.1); "
          f"2 threads take {med['busy, 1 thread'] / med['busy, 2 threads']:.3f}x")


if __name__ == "__main__":
    main()
