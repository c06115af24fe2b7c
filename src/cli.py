"""Command line: `python -m src.cli {fit,validate,test,predict} --config configs/lenet.yaml [...]`."""

from lightning.pytorch.cli import ArgsType, LightningCLI
from lightning.pytorch.utilities import rank_zero_info

import src.strategies  # noqa: F401  registers our strategies before any Trainer is built
from src.callbacks import EpochReport
from src.data.fashion_mnist import FashionMNISTDataModule
from src.launch_checks import check_before_run
from src.models.classifier import ImageClassifier


class CLI(LightningCLI):
    """LightningCLI plus `--test_after_fit` (evaluate the best checkpoint on the test set after fit) and the
    launch checks of `src.launch_checks`, run before any subcommand starts (and before DDP spawns processes)."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument("--test_after_fit", type=bool, default=False,
                            help="After fit, run the test set on the best checkpoint and log test/acc.")

    def _check(self) -> None:
        check_before_run(self.trainer, self.datamodule)

    before_fit = before_validate = before_test = before_predict = _check

    def after_fit(self) -> None:
        if not self.config.fit.get("test_after_fit"):
            return
        ckpt = self.trainer.checkpoint_callback
        best = "best" if ckpt is not None and getattr(ckpt, "best_model_path", "") else None
        results = self.trainer.test(self.model, datamodule=self.datamodule, ckpt_path=best)
        reports = [c for c in self.trainer.callbacks if isinstance(c, EpochReport)]
        images = f", {reports[0].test_images:,} test images" if reports else ""
        if results and "test/acc" in results[0]:
            rank_zero_info(f"test acc {results[0]['test/acc']:.4f} ({best or 'last'} weights{images}), "
                           f"run in {self.trainer.log_dir}")


def main(args: ArgsType = None) -> CLI:
    """Build and run the CLI; `args` (a list of strings) replaces sys.argv[1:] for tests."""
    return CLI(ImageClassifier, FashionMNISTDataModule, subclass_mode_model=True,
               seed_everything_default=42, args=args)


if __name__ == "__main__":
    main()
