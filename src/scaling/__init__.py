"""Scaling tools: the measured scaling report and the scaling predictor.

* `__main__`: `python -m src.scaling`, the measured scaling report (`src.scaling_report`, a module of its own that
  the predictor does not import): one config trained under several strategies and device counts.
* `predictor`: `python -m src.forecast`, images/s and efficiency predicted for 1 to thousands of devices, from
  `cost_model` (the step-time formulas) and `cost_fit` (fits to measurements, ranges), both pure Python,
  `hardware` (presets with sources), `layer_profile` (what is counted, profiled and timed from the model),
  `sources` (where each number comes from), `memory` (model-state bytes per device under the ZeRO stages, pure
  Python, and the optimizer and precision they assume), `three_ways` (data, pipeline and tensor parallelism: every
  layout per device count), `forecast_files` (every file and printed table: markdown, CSV and PNG, each forecast in
  a `version_N` folder of its own, numbered by `src.version_folders` as the scaling report's are).
* `calibrate`: `python -m src.forecast --calibrate`, timings of this machine into `calibration/*.json`.

Importing this package loads nothing: each module imports what it needs, so the cost model stays free of torch.
"""
