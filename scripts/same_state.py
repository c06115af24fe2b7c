"""Whether a change kept the arithmetic: short runs of this checkout and of an earlier commit end with bitwise the same
`last.ckpt` state (the model's state dict and the optimizer's state, tensor by tensor, `torch.equal`).

    python scripts/same_state.py --base 7cfa2db                 # every run below
    python scripts/same_state.py --base 7cfa2db --runs ours-1x2,zero2-2x1

The earlier commit is checked out into a temporary git worktree and each run is the CLI's own `fit` on synthetic
Fashion-MNIST files, one intra-op thread per process, the same command at both commits; the pipeline's cut is named,
since `cuts: auto` chose it by timing at some commits. Prints one line per run, "same" or what differs, and exits 1
if any run differs or fails. Both commits must run on this machine with the same thread count: float sums are
split and rounded by both.
"""

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
LENET, RESNET = ["--config", "configs/lenet.yaml"], ["--config", "configs/resnet18.yaml"]
OURS, PROCESSES = "configs/strategy/split_allreduce.yaml", "configs/strategy/split_allreduce_processes.yaml"
STRATEGY = "--trainer.strategy.init_args."
# the split models by class path, which every commit reads (configs/strategy/pipeline_cpu.yaml and
# tensor_parallel_cpu.yaml say the same through a `layout`, tests/test_mesh_layout.py)
SPLIT = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy.class_path"]
PIPELINE = [*SPLIT, "src.strategies.PipelineStrategy"]
#: name -> the CLI's arguments after `fit` (LeNet at batch 64 unless a run says otherwise)
RUNS: dict[str, list[str]] = {
    "ours-1x2": [*LENET, "--config", OURS],
    "ours-2x1": [*LENET, "--config", PROCESSES],
    "ours-2x2": [*LENET, "--config", PROCESSES, STRATEGY + "replicas_per_process", "2"],
    "zero1-1x2": [*LENET, "--config", "configs/strategy/split_allreduce_zero1.yaml"],
    "zero2-1x2": [*LENET, "--config", "configs/strategy/split_allreduce_zero2.yaml"],
    "zero1-2x1": [*LENET, "--config", PROCESSES, STRATEGY + "zero_stage", "1"],
    "zero2-2x1": [*LENET, "--config", PROCESSES, STRATEGY + "zero_stage", "2"],
    "powersgd-2x1": [*LENET, "--config", "configs/strategy/split_allreduce_powersgd.yaml",
                     STRATEGY + "compression.warmup_steps", "2"],
    "resnet18-syncbn-1x2": [*RESNET, "--config", OURS, "--trainer.sync_batchnorm", "true", "--data.batch_size", "16",
                            "--trainer.max_steps", "3"],
    "pipeline-gpipe": [*LENET, *PIPELINE, STRATEGY + "cuts", "[features.3]"],
    "pipeline-1f1b": [*LENET, *PIPELINE, STRATEGY + "cuts", "[features.3]", STRATEGY + "schedule", "1f1b"],
    "tensor": [*LENET, *SPLIT, "src.strategies.TensorParallelStrategy"],
}


def fit(checkout: Path, args: list[str], data: Path, logs: Path) -> Path:
    """Run `python -m src.cli fit ARGS` of `checkout` for 6 steps (a run may say fewer) and return its last.ckpt.

    Raises:
        RuntimeError: The run failed (its last lines in the message) or wrote no last.ckpt.
    """
    command = [sys.executable, "-m", "src.cli", "fit", *args, "--data.data_dir", str(data), "--data.download",
               "false", "--data.val_size", "100", "--trainer.max_epochs", "1", "--trainer.limit_val_batches", "1",
               "--trainer.enable_progress_bar", "false", "--test_after_fit", "false", "--threads", "1",
               "--trainer.logger.init_args.save_dir", str(logs)]
    if "--trainer.max_steps" not in args:
        command += ["--trainer.max_steps", "6"]
    if "--data.batch_size" not in args:
        command += ["--data.batch_size", "64"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(command, cwd=checkout, env=env, text=True, capture_output=True, timeout=600)
    found = sorted(logs.rglob("last.ckpt"))
    if done.returncode != 0 or not found:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-8:])
        raise RuntimeError(f"exit {done.returncode}, {len(found)} last.ckpt: {tail}")
    return found[-1]


def differences(a: Path, b: Path) -> list[str]:
    """What differs between two checkpoints' model state and optimizer state (empty: bitwise the same)."""
    ca, cb = (torch.load(p, map_location="cpu", weights_only=False) for p in (a, b))
    found = []
    sa, sb = ca["state_dict"], cb["state_dict"]
    if sorted(sa) != sorted(sb):
        found.append(f"state_dict keys {sorted(set(sa) ^ set(sb))}")
    found += [f"state_dict[{k}]" for k in sorted(set(sa) & set(sb)) if not torch.equal(sa[k], sb[k])]
    for n, (oa, ob) in enumerate(zip(ca["optimizer_states"], cb["optimizer_states"])):
        if sorted(oa["state"]) != sorted(ob["state"]):
            found.append(f"optimizer {n} state keys")
            continue
        found += [f"optimizer {n} state[{i}][{key}]" for i in oa["state"] for key, t in oa["state"][i].items()
                  if torch.is_tensor(t) and not torch.equal(t, ob["state"][i].get(key))]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="7cfa2db", help="the earlier commit")
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated names: " + ", ".join(RUNS))
    parser.add_argument("--control", action="store_true",
                        help="first show that the check sees a change: the first run with this checkout's lr "
                             "raised by one part in a million must differ")
    args = parser.parse_args(argv)
    names = args.runs.split(",")
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"unknown runs {unknown}; choose from {', '.join(RUNS)}")
    sys.path.insert(0, str(ROOT))
    from src.data.synthetic import write_fashion_mnist

    failed = False
    with tempfile.TemporaryDirectory(prefix="same-state-") as tmp:
        tmp_path = Path(tmp)
        base = tmp_path / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base), args.base], cwd=ROOT, check=True)
        try:
            write_fashion_mnist(tmp_path / "data" / "FashionMNIST" / "raw")
            if args.control:
                lr = ["--model.init_args.lr", "0.05000005"]  # configs/lenet.yaml's 0.05, one part in a million up
                found = differences(fit(base, RUNS[names[0]], tmp_path / "data", tmp_path / "control" / "old"),
                                    fit(ROOT, RUNS[names[0]] + lr, tmp_path / "data", tmp_path / "control" / "new"))
                print(f"control, {names[0]} with lr x (1 + 1e-6): {'DIFFERS, as it must' if found else 'SAME'}")
                failed |= not found
            for name in names:
                try:
                    new = fit(ROOT, RUNS[name], tmp_path / "data", tmp_path / "new" / name)
                    old = fit(base, RUNS[name], tmp_path / "data", tmp_path / "old" / name)
                    found = differences(old, new)
                except RuntimeError as e:
                    found = [f"failed: {e}"]
                failed |= bool(found)
                print(f"{name}: {'same' if not found else 'DIFFERS: ' + '; '.join(found[:6])}", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
