"""Callbacks, one per file: what a run logs and prints, kept apart from what the strategies compute.

The names below are also the `class_path`s that configs and the `config.yaml` of saved runs use
(`src.callbacks.EpochReport`, ...).
"""

from src.callbacks.class_report import ClassReport
from src.callbacks.epoch_report import EpochReport
from src.callbacks.hparams_metrics import HParamsMetrics
from src.callbacks.last_checkpoint import LastCheckpoint
from src.callbacks.prediction_writer import PredictionWriter
from src.callbacks.process_group_cleanup import ProcessGroupCleanup
from src.callbacks.restart_report import RestartReport
from src.callbacks.step_timeline import StepTimeline
from src.callbacks.strategy_metrics import StrategyMetrics
from src.callbacks.validate_at_max_steps import ValidateAtMaxSteps

__all__ = ["ClassReport", "EpochReport", "HParamsMetrics", "LastCheckpoint", "PredictionWriter", "ProcessGroupCleanup",
           "RestartReport", "StepTimeline", "StrategyMetrics", "ValidateAtMaxSteps"]
