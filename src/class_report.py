"""Old import path of `src.callbacks.class_report.ClassReport`, kept so that the config.yaml of runs
saved before it moved still loads."""

from src.callbacks.class_report import ClassReport

__all__ = ["ClassReport"]
