"""The scaling predictor's ranges against published multi-GPU measurements, calibration and held-out rows apart.

    python -m benchmarks.scaling_validation            # markdown table, one line per row, then a summary per split

Each row of `src/scaling/calibration/published_scaling.csv` (its source, file, commit and row are in the table)
is predicted from what a user would give the predictor: the parameter count, the one-GPU images/s at the
batch per GPU, the hardware preset, the GPU count and the precision (`src.scaling.published.predict_setting`,
ring allreduce, float32 gradients). The sync-overhead bounds are fitted on the calibration rows only; the
held-out rows (other networks, systems, software releases and frameworks) are never fitted to. Rows whose
precision has no calibrated kind (NVIDIA's APEX AMP) are predicted as "unknown", with both kinds' bounds.

The summary gives, per split: the share of rows whose published efficiency lies inside the predicted range,
the median |midpoint of the range - published| and the median width of the range.
"""

import statistics

from src.scaling.published import bounds_for, fit_sync, load_table, predict_setting, setting_of


def validate() -> dict[str, dict[str, float]]:
    """Print the table and summary; return {split: {"rows", "inside", "median_error", "median_width"}}."""
    print("| split | row | network | system | precision | GPUs | published | predicted range | midpoint "
          "| point | inside |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    results: dict[str, list[tuple[bool, float, float]]] = {}
    for r in load_table():
        band = predict_setting(setting_of(r), bounds_for(r.precision_class))
        low, high = band.low.efficiency, band.high.efficiency
        mid = (low + high) / 2
        inside = low <= r.efficiency <= high
        results.setdefault(r.split, []).append((inside, abs(mid - r.efficiency), high - low))
        precision = r.precision if r.precision_class else f"{r.precision} (as unknown)"
        print(f"| {r.split} | {r.id} | {r.network} | {r.system} | {precision} | {r.gpus} | {r.efficiency:.3f} "
              f"| {low:.3f}–{high:.3f} | {mid:.3f} | {band.point.efficiency:.3f} | {'yes' if inside else 'no'} |")
    print()
    for name, fit in fit_sync().items():
        print(f"sync overhead, {name}: {fit.bounds[0]:.2%} to {fit.bounds[1]:.2%} (mean {fit.mean:.2%} of "
              f"{len(fit.implied)} calibration rows, pooled spread {fit.spread:.2%}, t {fit.t:.3f})")
    summary = {}
    print("\n| split | rows | inside the range | median abs(midpoint - published) | median width |")
    print("|---|---|---|---|---|")
    for split, rows in results.items():
        summary[split] = {"rows": len(rows), "inside": sum(i for i, _, _ in rows) / len(rows),
                          "median_error": statistics.median(e for _, e, _ in rows),
                          "median_width": statistics.median(w for _, _, w in rows)}
        s = summary[split]
        print(f"| {split} | {s['rows']} | {sum(i for i, _, _ in rows)} ({s['inside']:.0%}) | {s['median_error']:.3f} "
              f"| {s['median_width']:.3f} |")
    return summary


if __name__ == "__main__":
    validate()
