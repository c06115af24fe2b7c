"""Command line: `python -m src.cli {fit,validate,test,predict} --config configs/lenet.yaml [...]`.

A bad input ends with exit status 2 and, on stderr, `error: <what is wrong and how to fix it>` and a line naming
`--debug` (or FMNIST_DEBUG=1), which shows the full traceback instead (docs/troubleshooting.md).
"""

import os
import sys
from pathlib import Path
from typing import Any, Optional

import src.run.hidden_messages  # noqa: F401  first: the few third-party messages every run hides (see the module)
from lightning.pytorch.cli import ArgsType, LightningCLI, SaveConfigCallback
from lightning.pytorch.utilities import rank_zero_info

import src.strategies.ddp_compression  # noqa: F401  registers `ddp_bf16`, `ddp_powersgd` likewise
import src.strategies.pipeline  # noqa: F401  registers `pipeline` likewise
import src.strategies.tensor_parallel  # noqa: F401  registers `tensor_parallel` likewise
import src.strategies.split_allreduce  # noqa: F401  registers `split_allreduce` before any Trainer is built
from src.callbacks import EpochReport, HParamsMetrics, PredictionWriter, ProcessGroupCleanup, RestartReport
from src.data.fashion_mnist import FashionMNISTDataModule
from src.layout import SplitsByWeight, parallel_layout
from src.mesh_layout import MeshLayout, apply_layout
from src.models.classifier import ImageClassifier
from src.run.checkpoints import check_checkpoint, keep_saved_folders, resolve_last_checkpoint
from src.run.class_paths import register as register_class_paths
from src.run.cleanup import register as register_process_group_cleanup
from src.run.elastic import apply_launcher_layout, resolve_auto_checkpoint, weights_after_restart
from src.run.errors import DEBUG_ENV, RaisingArgumentParser, check_config_files, describe
from src.run.launch_checks import check_before_run
from src.run.lightning_compat import fix_version_before_launch, give_lost_rank_reports_time
from src.run.matmul_precision import choose as choose_matmul_precision
from src.run.hparams_table import length_words
from src.run.logger import RunLogger, discard_unfinished_runs, run_hparams, run_tag
from src.run.progress import lines_when_not_a_terminal, summary_on_stderr
from src.run.threads import apply as use_threads
from src.run.threads import choose_threads, saved_threads
from src.strategies.compression_state import KEY as COMPRESSION_KEY
from src.strategies.compression_state import describe as describe_compression
from src.strategies.split_allreduce import SplitAllreduceStrategy


class CLI(LightningCLI):
    """LightningCLI plus `--test_after_fit` (evaluate the best checkpoint on the test set after fit) and the
    launch checks of `src.run.launch_checks`, run before any subcommand starts (and before DDP spawns processes)."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument("--test_after_fit", type=bool, default=False,
                            help="After fit, run the test set on the best checkpoint and log test/acc.")
        parser.add_argument("--threads", type=Optional[int], default=None,
                            help="Intra-op threads per training process (default: OMP_NUM_THREADS if set, else the "
                                 "cores left free by other programs, divided among this machine's processes).")
        parser.add_argument("--layout", type=Optional[MeshLayout], default=None,
                            help="The device mesh by its degrees, {data: D, pipeline: P, tensor: T}, and the options "
                                 "of its ways: sets trainer.devices and trainer.strategy (src/mesh_layout.py).")

    def _parse_ckpt_path(self) -> None:
        # LightningCLI would take the model's class and hyperparameters from a --ckpt_path checkpoint, so a
        # checkpoint of another network silently replaces the configured one. Here the config decides, and
        # check_checkpoint says when a checkpoint does not fit it.
        return

    def before_instantiate_classes(self) -> None:
        # Runs go under trainer.default_root_dir (configs/defaults.yaml: logs) unless the logger's save_dir is given
        trainer = self.config[self.subcommand].trainer
        apply_launcher_layout(trainer)  # under torchrun: the nodes of this rendezvous round, not a fixed number
        apply_layout(self.config[self.subcommand].get("layout"), trainer)  # devices and strategy, over those nodes
        logger = trainer.get("logger")
        if getattr(logger, "class_path", None) == f"{RunLogger.__module__}.{RunLogger.__name__}":
            if logger.init_args.get("save_dir") is None or self.subcommand == "predict":
                # predict: the command line's default_root_dir, not the save_dir of the run's config.yaml
                logger.init_args.save_dir = trainer.get("default_root_dir") or "logs"
        self._experiment = _configured_experiment_dir(logger, trainer.get("default_root_dir") or "logs")
        if self.subcommand == "predict":
            trainer.logger = False  # a predict run adds no TensorBoard run (and no empty HPARAMS row)

    def _check(self) -> None:
        strategy = self.trainer.strategy
        if isinstance(strategy, SplitsByWeight):  # before setup, where the strategy builds its shares
            strategy.split_weights = weights_after_restart(strategy.split_weights,
                                                           parallel_layout(strategy).total_replicas)
        check_before_run(self.trainer, self.datamodule, self.model, fitting=self.subcommand == "fit")
        for callback in (ProcessGroupCleanup, RestartReport, HParamsMetrics):  # missing from older config.yaml
            if not any(isinstance(c, callback) for c in self.trainer.callbacks):
                self.trainer.callbacks.append(callback())  # ProcessGroupCleanup reaches ddp_spawn's workers too
        config = self.config_init[self.subcommand]
        lines_when_not_a_terminal(self.trainer, self.config[self.subcommand].trainer)  # no `\r` bar into a file
        summary_on_stderr(self.trainer, self.config[self.subcommand].trainer)  # the same output with `rich` or not
        layout = parallel_layout(self.trainer.strategy)
        processes = layout.processes // max(self.trainer.num_nodes, 1)
        choose_matmul_precision({d.type for d in layout.replica_devices})  # TF32 on all-GPU runs (see the module)
        logger = self.trainer.logger
        if isinstance(logger, RunLogger):
            stage = "" if self.subcommand == "fit" else f"{self.subcommand}/"
            batch = getattr(self.datamodule, "batch_size", None)
            logger.describe_run(stage + run_tag(self.trainer),
                                run_hparams(self.trainer, batch, self.config[self.subcommand].get("seed_everything")))
        checkpoint = self._resolve_checkpoint(config, logger)
        # chosen once the checkpoint is known: a resumed fit keeps the threads its run used (src/run/threads.py)
        choice = choose_threads(self.config[self.subcommand].get("threads"), processes,
                                saved=saved_threads(checkpoint) if self.subcommand == "fit" else None)
        use_threads(choice)
        for callback in self.trainer.callbacks:
            if isinstance(callback, RestartReport):
                callback.thread_choice = choice  # its restart line says which count the resumed run uses
        if isinstance(logger, RunLogger):
            logger.run_hparams["run/threads"] = choice.threads  # described above, before the count was chosen
        fix_version_before_launch(self.trainer)  # after `--ckpt_path auto`, which may choose an existing one
        if isinstance(logger, RunLogger):
            logger.note_folder()  # a new folder is removed again if the run is refused (`discard_unfinished_runs`)

    before_fit = before_validate = before_test = _check

    def _resolve_checkpoint(self, config: Any, logger: Any) -> dict | None:
        """The checkpoint options of this command, checked and resolved (`last`, `auto`), and the checkpoint they
        name, read and checked (None without one).

        Raises:
            ValueError: validate/test/predict without a checkpoint, `--weights_only false`, `auto` outside fit, or
                a checkpoint that does not fit the model.
        """
        if self.subcommand != "fit" and not config.get("ckpt_path"):
            raise ValueError(f"{self.subcommand} without --ckpt_path would use untrained weights: give the checkpoint "
                             "to evaluate, e.g. --ckpt_path last (the newest last.ckpt of this model) or "
                             "--ckpt_path logs/<model>/<run>/version_N/checkpoints/last.ckpt")
        if config.get("weights_only") is False:
            raise ValueError("--weights_only false is refused: it lets a checkpoint run code while it loads. This tool "
                             "loads checkpoints with torch's weights-only unpickler only (see docs/security.md)")
        if "weights_only" in config:
            config["weights_only"] = True  # explicit: torch then ignores TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD
        if str(self.trainer.precision) == "64-true":
            # Lightning loads a checkpoint into the model before it converts the model to float64: loaded into
            # float32 weights, a float64 checkpoint would be rounded, and a resumed run would not continue exactly
            self.model.double()
        if config.get("ckpt_path") == "auto":
            if self.subcommand != "fit":
                raise ValueError(f"--ckpt_path auto resumes training; {self.subcommand} takes a checkpoint's path "
                                 "or last")
            config["ckpt_path"] = resolve_auto_checkpoint(logger)
            for callback in self.trainer.callbacks:  # the run's folder is this job's: a restart rewrites config.yaml
                if isinstance(callback, SaveConfigCallback):
                    callback.overwrite = True
        checkpoint = None
        if config.get("ckpt_path"):
            config["ckpt_path"] = resolve_last_checkpoint(config["ckpt_path"],
                                                          _experiment_dir(logger) or self._experiment)
            checkpoint = check_checkpoint(config["ckpt_path"], self.model)
            saved = (checkpoint or {}).get(COMPRESSION_KEY)
            if self.subcommand == "fit" and saved and not isinstance(self.trainer.strategy, SplitAllreduceStrategy):
                rank_zero_info(f"gradient compression: the checkpoint's {describe_compression(saved)} state is not "
                               "used (this run's strategy does not read it)")
            if self.subcommand != "fit" and checkpoint is not None:
                keep_saved_folders(self.trainer.callbacks, checkpoint)
                if isinstance(logger, RunLogger) and isinstance(checkpoint.get("global_step"), int):
                    logger.describe_length(length_words(checkpoint["global_step"]))  # what the checkpoint trained
        return checkpoint

    def before_predict(self) -> None:
        """Every image of `data.predict_dir`, then the launch checks (so a refused file stops the run before any
        prediction is made); predictions go to `<default_root_dir>/<model>/predict/predictions_<N>.csv` through a
        `PredictionWriter` (one is added when the config has none, e.g. the config.yaml of an older run) instead of
        being kept in memory."""
        if getattr(self.datamodule, "predict_dir", None) is not None:
            self.datamodule.check_predict_files()  # first: a refused image is the first thing to fix
        self._check()
        # predict is not a run: it saves no config.yaml (it would land in default_root_dir itself)
        self.trainer.callbacks = [c for c in self.trainer.callbacks if not isinstance(c, SaveConfigCallback)]
        if not any(isinstance(c, PredictionWriter) for c in self.trainer.callbacks):
            self.trainer.callbacks.append(PredictionWriter())
        for writer in self.trainer.callbacks:
            if isinstance(writer, PredictionWriter) and writer.directory is None and self._experiment is not None:
                writer.directory = str(self._experiment / "predict")
        self.config_init[self.subcommand]["return_predictions"] = False

    def after_fit(self) -> None:
        if not self.config.fit.get("test_after_fit"):
            return
        ckpt = self.trainer.checkpoint_callback
        # the path itself, not "best": LastCheckpoint is a second ModelCheckpoint, and Lightning warns that
        # "best" then means the first one's
        best = getattr(ckpt, "best_model_path", "") or None
        for callback in self.trainer.callbacks:  # fit saved the run's config.yaml; with forked or spawned workers
            if isinstance(callback, SaveConfigCallback):  # it did so in a worker, and this copy never heard of it
                callback.already_saved = True
        results = self.trainer.test(self.model, datamodule=self.datamodule, ckpt_path=best, weights_only=True)
        reports = [c for c in self.trainer.callbacks if isinstance(c, EpochReport)]
        images = f", {reports[0].test_images:,} test images" if reports else ""
        if results and "test/acc" in results[0]:
            rank_zero_info(f"test acc {results[0]['test/acc']:.4f} ({'best' if best else 'last'} weights{images}), "
                           f"run in {self.trainer.log_dir}")

    def after_validate(self) -> None:
        _say_where_it_went(self.trainer, "val")

    def after_test(self) -> None:
        _say_where_it_went(self.trainer, "test")


def _say_where_it_went(trainer: Any, stage: str) -> None:
    """One line on stderr after `validate` or `test`, as fit's last line: the accuracy and the run's folder (e.g.
    "test acc 0.9166 (10,000 test images), run in logs/lenet/test/single-1x1-cpu/version_0"), or that no folder
    was written."""
    acc = trainer.callback_metrics.get(f"{stage}/acc")
    reports = [c for c in trainer.callbacks if isinstance(c, EpochReport)] if stage == "test" else []
    images = f" ({reports[0].test_images:,} test images)" if reports else ""
    words = f"{stage} acc {float(acc):.4f}{images}, " if acc is not None else ""
    where = f"run in {trainer.log_dir}" if trainer.loggers else "no run folder written (trainer.logger is off)"
    rank_zero_info(words + where)


DEFAULTS = Path(__file__).resolve().parent.parent / "configs" / "defaults.yaml"


def _configured_experiment_dir(logger: object, default_root_dir: str) -> Path | None:
    """`<save_dir>/<experiment name>` from the logger's config, before it is instantiated (None without one)."""
    init_args = getattr(logger, "init_args", None)
    name = init_args.get("name") if init_args is not None else None
    if not name:
        return None
    return Path(init_args.get("save_dir") or default_root_dir) / name


def _experiment_dir(logger: object) -> Path | None:
    """`<save_dir>/<model>`, the folder that holds every run of this model (None without a logger)."""
    if isinstance(logger, RunLogger):
        return Path(logger.save_dir) / logger.experiment_name
    root = getattr(logger, "root_dir", None)
    return Path(root) if root else None


def main(args: ArgsType = None) -> CLI:
    """Build and run the CLI; `args` (a list of strings) replaces sys.argv[1:] for tests.

    `configs/defaults.yaml` (what every experiment shares) is read before any --config file.
    """
    # every config is read through the table of moved class paths, so a saved config.yaml of an older run loads
    defaults = {"default_config_files": [str(DEFAULTS)], "parser_mode": register_class_paths()}
    # auto_configure_optimizers=False: the optimizer and lr schedule are the model's recipe (model.init_args),
    # so LightningCLI's --optimizer / --lr_scheduler, which would silently replace them, do not exist
    return CLI(ImageClassifier, FashionMNISTDataModule, subclass_mode_model=True, seed_everything_default=42,
               args=args, parser_class=RaisingArgumentParser, auto_configure_optimizers=False,
               parser_kwargs={"parser_mode": defaults["parser_mode"],
                              **{command: defaults for command in ("fit", "validate", "test", "predict")}})


def run(argv: list[str] | None = None) -> int:
    """Entry point of `python -m src.cli`: run `main`, turning any error into one line and exit status 2.

    Args:
        argv: Arguments (default sys.argv[1:]); `--debug` anywhere re-raises errors with their traceback.

    Returns:
        0 on success, 2 after an error (printed to stderr).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    register_process_group_cleanup()  # this process, and DDP's popen children and torchrun workers, which run this
    give_lost_rank_reports_time()
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "0") not in ("", "0")
    saved_env = os.environ.get(DEBUG_ENV)
    if "--debug" in argv:
        os.environ[DEBUG_ENV] = "1"  # DDP re-runs this command line, without --debug, in its other processes
    argv = [a for a in argv if a != "--debug"]
    # through sys.argv, not args=: DDP's launcher re-runs sys.argv in its other processes, and LightningCLI
    # warns when both are given
    saved, sys.argv = sys.argv, sys.argv[:1] + argv
    try:
        check_config_files(argv)
        main()
    except Exception as err:  # every failure, ours or a library's, ends in the same one-line report
        discard_unfinished_runs()  # a refused run leaves no folder, whenever it is refused
        if debug:
            raise
        print(f"error: {describe(err)}\n(add --debug or set {DEBUG_ENV}=1 for the full traceback)", file=sys.stderr)
        return 2
    finally:
        sys.argv = saved
        if saved_env is None:
            os.environ.pop(DEBUG_ENV, None)
        else:
            os.environ[DEBUG_ENV] = saved_env
    return 0


if __name__ == "__main__":
    sys.exit(run())
