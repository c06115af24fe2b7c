"""Old import path of `src.run.logger.RunLogger`, kept so that the config.yaml of runs
saved before it moved still loads."""

from src.run.logger import RunLogger

__all__ = ["RunLogger"]
