"""Command-line arguments that keep a real `python -m src.cli` run to a few batches of the tiny data."""

from pathlib import Path


def data_args(data_dir: str | Path, batch_size: int = 64) -> list[str]:
    """The tiny data set (see `idx.write_fashion_mnist`), 100 images held out, no download."""
    return ["--data.data_dir", str(data_dir), "--data.val_size", "100", "--data.batch_size", str(batch_size),
            "--data.download", "false"]


def trainer_args(save_dir: str | Path | None = None, max_epochs: int = 1, train_batches: int | None = None,
                 eval_batches: int = 2) -> list[str]:
    """A short run without a progress bar: `max_epochs`, at most `train_batches` (None: all) and
    `eval_batches` batches per epoch; logs and checkpoints under `save_dir` when given."""
    args = ["--trainer.max_epochs", str(max_epochs), "--trainer.limit_val_batches", str(eval_batches),
            "--trainer.limit_test_batches", str(eval_batches), "--trainer.enable_progress_bar", "false"]
    if train_batches is not None:
        args += ["--trainer.limit_train_batches", str(train_batches)]
    if save_dir is not None:
        args += ["--trainer.logger.init_args.save_dir", str(save_dir)]
    return args


def fast_args(data_dir: str | Path, save_dir: str | Path) -> list[str]:
    """One epoch of 3 training batches (global batch 64) and 2 evaluation batches."""
    return [*data_args(data_dir), *trainer_args(save_dir, train_batches=3)]


# A run of the tiny data that a lost process can resume mid-epoch: the epoch line, and last.ckpt every 4 steps
RESUMABLE_CALLBACKS = """trainer:
  callbacks:
    - class_path: src.callbacks.EpochReport
    - class_path: src.callbacks.LastCheckpoint
      init_args: {every_n_train_steps: 4}
"""
# float64 (to compare with one device), no test after fit, no sanity validation
RESUMABLE_FLOAT64 = ["--trainer.precision", "64-true", "--test_after_fit", "false", "--trainer.num_sanity_val_steps",
                     "0"]


def process_option(overlay_args: str | list[str], name: str) -> str:
    """The CLI flag of the process setting `name` ("start_method", "timeout", "backend") for the strategy the overlay
    names: ours (split_allreduce, pipeline, tensor_parallel) group the three under `processes`, Lightning's DDP
    takes them flat (`process_group_backend` for the backend)."""
    text = overlay_args if isinstance(overlay_args, str) else " ".join(overlay_args)
    if _has_layout(text):  # a preset of the layout (src/mesh_layout.py): the layout's group
        return f"--layout.processes.{name}"
    if any(name in text for name in ("split_allreduce", "pipeline", "tensor_parallel")) or _groups_processes(text):
        return f"--trainer.strategy.init_args.processes.{name}"  # ours: the group
    return f"--trainer.strategy.init_args.{'process_group_backend' if name == 'backend' else name}"


def _overlays(text: str) -> list[dict]:
    """The strategy overlays (configs/strategy/<name>.yaml) named in `text`, read."""
    import yaml

    root = Path(__file__).resolve().parents[2]
    return [yaml.safe_load((root / word).read_text()) or {} for word in text.split()
            if word.startswith("configs/strategy/") and (root / word).is_file()]


def _has_layout(text: str) -> bool:
    """Whether an overlay named in `text` is a preset of the layout."""
    return any("layout" in overlay for overlay in _overlays(text))


def _groups_processes(text: str) -> bool:
    """Whether a strategy overlay named in `text` (configs/strategy/<name>.yaml) gives its strategy a `processes`
    group, as ours do whatever the overlay's name."""
    for overlay in _overlays(text):
        strategy = overlay.get("trainer", {}).get("strategy")
        if isinstance(strategy, dict) and "processes" in (strategy.get("init_args") or {}):
            return True
    return False
