"""Old import path of `src.callbacks.prediction_writer.PredictionWriter`, kept so that the config.yaml of runs
saved before it moved still loads."""

from src.callbacks.prediction_writer import PredictionWriter

__all__ = ["PredictionWriter"]
