"""Scaling tools: the measured scaling report and the scaling predictor.

* `__main__`: `python -m src.scaling`, the measured scaling report (`src.scaling_report`, which the predictor does
  not import): one config trained under several strategies and device counts.
* `predictor`: `python -m src.forecast`, images/s and efficiency predicted for 1 to thousands of devices, from
  `cost_model` and `cost_fit` (step-time formulas and fits, pure Python), `hardware` and `sources` (presets, and where
  each number comes from), `layer_profile` (the model counted, profiled and timed), `memory` (ZeRO's bytes per
  device), `three_ways` (data, pipeline and tensor parallelism) and `forecast_files` (every file and table written).
* `calibrate`: `python -m src.forecast --calibrate`, timings of this machine into `calibration/*.json`.

Importing this package loads nothing: each module imports what it needs, so the cost model stays free of torch.
"""
