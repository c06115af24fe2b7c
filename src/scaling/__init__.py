"""Scaling tools: the measured scaling report and the scaling predictor.

* `report`: `python -m src.scaling`, one config trained under several strategies and device counts.
* `forecast`: `python -m src.forecast`, images/s and efficiency predicted for 1 to thousands of devices, from
  `cost_model` (the step-time formulas) and `cost_fit` (fits to measurements, ranges), both pure Python,
  `hardware` (presets with sources), `network` (what is counted from the model), `sources` (where each number
  comes from) and `forecast_files` (its markdown, CSV and PNG).
* `calibrate`: `python -m src.forecast --calibrate`, timings of this machine into `calibration/*.json`.

Importing this package loads nothing: each module imports what it needs, so the cost model stays free of torch.
"""
