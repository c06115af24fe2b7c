"""A synthetic calibration file for the forecast's tests: known link and compute costs, nothing measured."""

import json
from pathlib import Path

from src.scaling.cost_model import Link, ring_allreduce_s


def write_calibration(path: Path) -> Path:
    """Write a calibration of alpha 2e-4 s, beta 1e-9 s/byte for both allreduces and LeNet's compute of 4 ms per
    step + 50 us per image (1 thread) to `path`; returns it."""
    samples = [[2, n, ring_allreduce_s(2, n, Link(2e-4, 1e-9))] for n in (4096, 2**20, 2**26)]
    fit = {"alpha_s": 2e-4, "beta_s_per_byte": 1e-9, "samples": samples,
           "fit": {"rms_rel_err": 0.0, "max_rel_err": 0.0}}
    path.write_text(json.dumps({
        "date": "2000-01-01", "hardware": "synthetic", "allreduce": {"torch": fit, "ring": fit},
        "compute": {"LeNetClassifier": {"overhead_s": 0.004, "seconds_per_image": 50e-6, "threads": 1,
                                        "samples": [[32, 0.0056], [256, 0.0168]],
                                        "fit": {"rms_rel_err": 0.0, "max_rel_err": 0.0}}}}))
    return path
