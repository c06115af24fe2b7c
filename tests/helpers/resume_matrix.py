"""Resume checkpoints under several strategies in the same processes: `python -m tests.helpers.resume_matrix
OVERLAY,OVERLAY,... DATA_DIR OUT NAME=CKPT ...`, started once for the strategies of one process and once for those
of two (in 2 processes told their ranks as Lightning's launcher tells them), so the resume matrix pays a process
start per number of processes, not per strategy.

Each checkpoint is resumed through `src.cli.run` (the app's command line, in this process) for 2 more steps; at the
start of training `StateAtStart` takes the model and the optimizer state in one device's format, through the
strategy's own checkpoint hooks (on rank 0). Rank 0 writes `OUT/<overlay>/<name>.pt`: the exit status, the error
line, the global step at the end, and that state. Also `make DATA_DIR OUT OVERLAY=NAME ...`: a new 2-step run (a
source) under each strategy in turn, all in these processes.
"""

import contextlib
import copy
import io
import sys
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from src.cli import run
from tests.helpers import cli_args

SEEN: dict = {}  # what the last run's StateAtStart took, on rank 0


class StateAtStart(Callback):
    """Takes the whole model and optimizer state as the strategy would save them now, once training starts (after
    Lightning restored the checkpoint): a collective under the split strategies, so every rank runs it."""

    def on_train_start(self, trainer, pl_module):
        strategy = trainer.strategy
        model = strategy.lightning_module_state_dict()
        optimizers = [strategy.optimizer_state(o) for o in trainer.optimizers]
        if trainer.is_global_zero:
            # copies: a state dict may hold the very tensors that the next steps update in place
            SEEN.update(model={k: v.detach().cpu().clone() for k, v in model.items()},
                        optimizers=copy.deepcopy(optimizers))


class StepAtEnd(Callback):
    """The global step when training ends."""

    def on_train_end(self, trainer, pl_module):
        SEEN["global_step"] = trainer.global_step


def fit_args(overlay: str, data_dir: str, save_dir: Path, max_steps: int, eval_batches: int = 1) -> list[str]:
    """A run of `max_steps` steps of the tiny data in global batches of 64, `eval_batches` validation batches, no
    test after."""
    strategy = [] if overlay == "none" else ["--config", f"configs/strategy/{overlay}.yaml"]
    return ["fit", "--config", "configs/lenet.yaml", *strategy, *cli_args.data_args(data_dir),
            *cli_args.trainer_args(save_dir, max_epochs=5, eval_batches=eval_batches),
            "--trainer.max_steps", str(max_steps),
            "--trainer.num_sanity_val_steps", "0", "--test_after_fit", "false"]


def resume(overlay: str, data_dir: str, out: Path, name: str, ckpt: str) -> dict:
    """Resume `ckpt` for 2 more steps without validation (what the matrix checks is restored before the first step,
    and a validation costs a resume about 0.8 s of its 2 on a 2-core CPU); the result (`StateAtStart`'s state, exit
    status, error line, last step)."""
    from tests.helpers.resume_matrix import SEEN  # the callbacks' module (this one may run as __main__)

    SEEN.clear()
    saved_step = torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = run([*fit_args(overlay, data_dir, out / name, saved_step + 2, eval_batches=0), "--ckpt_path", ckpt,
                    "--trainer.callbacks+=tests.helpers.resume_matrix.StateAtStart",
                    "--trainer.callbacks+=tests.helpers.resume_matrix.StepAtEnd"])
    errors = [line for line in err.getvalue().splitlines() if line.startswith("error: ")]
    return {**SEEN, "code": code, "error": errors[0] if errors else "", "saved_step": saved_step}


def main(argv: list[str]) -> None:
    """`make DATA_DIR OUT OVERLAY=NAME ...` or `OVERLAY,... DATA_DIR OUT NAME=CKPT ...` (the module's docstring)."""
    if argv[0] == "make":  # make DATA_DIR OUT OVERLAY=NAME ...: OUT/NAME/<run>, one after another
        for pair in argv[3:]:
            overlay, name = pair.split("=", 1)
            if run(fit_args(overlay, argv[1], Path(argv[2]) / name, 2)):
                sys.exit(f"the {name} run failed")
        return
    if argv[0] == "fit":  # the command line a strategy's launcher runs again in its other processes
        sys.exit(run(argv))
    overlays, data_dir, out = argv[0].split(","), argv[1], Path(argv[2])
    for overlay in overlays:  # OUT/OVERLAY/NAME.pt, each strategy in turn in these processes
        (out / overlay).mkdir(parents=True, exist_ok=True)
        for pair in argv[3:]:
            name, ckpt = pair.split("=", 1)
            result = resume(overlay, data_dir, out / overlay, name, ckpt)
            if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
                continue
            torch.save(result, out / overlay / f"{name}.pt")


if __name__ == "__main__":
    main(sys.argv[1:])
