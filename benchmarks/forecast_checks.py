"""The scaling predictor against measurements: allreduce on loopback, epoch times on the CPU; d2l.ai's tables.

    python -m benchmarks.forecast_checks allreduce            # fresh timings (about a minute) vs the calibration
    python -m benchmarks.forecast_checks epoch logs/scaling/lenet/version_0   # a scaling report vs predictions
    python -m benchmarks.forecast_checks d2l                  # sanity check against d2l.ai's MXNet figures
    python -m benchmarks.forecast_checks published            # ranges against published multi-GPU measurements

`allreduce` times `dist.all_reduce` and our ring again (a run independent of the one the calibration was fitted
on) and compares each with the fitted alpha-beta prediction. The goal, ±30% for P = 2, is judged at three
sizes fixed in advance: 64 KiB (latency-bound), LeNet's gradient and ResNet-18's gradient. The calibration
leaves these three sizes out of its fit (`src.scaling.calibrate.CHECK_SIZES`).

`epoch` predicts each run of a `python -m src.scaling` report (ddp: `dist.all_reduce`; split_allreduce_processes:
our ring; single: one replica) at its global batch, strong scaling, and prints predicted against measured
sec/epoch (medians over the epochs after the first).

`d2l` is a sanity check, not a validation: the ResNet-18 figures (13.2 and 7.3 sec/epoch) are the MXNet
version of d2l.ai's chapter (gluon's `split_and_load` and trainer, not PyTorch's `nn.DataParallel`), and the
per-step overhead is fitted on the same chapters' one-GPU times. It feeds the model those one-GPU epoch times, our
gradient sizes, PCIe 3.0 at its line rate (assumed interconnect) and reduce-to-GPU-0-then-broadcast, and prints
its two-GPU predictions next to the chapters' figures. The validation against published multi-GPU
measurements is `published`.

`published`: each row of `src/scaling/calibration/published_scaling.csv` (its source, file, commit and row are in
the table) is predicted from what a user would give the predictor: the parameter count, the one-GPU images/s at the
batch per GPU, the hardware preset, the GPU count and the precision (`src.scaling.published.predict_published`,
ring allreduce, float32 gradients). The sync-overhead bounds are fitted on the calibration rows only; the
held-out rows (other networks, systems, software releases and frameworks) are never fitted to. Rows whose
precision has no calibrated kind (NVIDIA's APEX AMP) are predicted as "unknown", with both kinds' bounds. The
sync overhead is a line in the row's gradient rate (float32 gradient bytes per second of its one-GPU step),
one intercept per precision kind, and its bounds the line's 90% prediction interval at that rate.
It prints a markdown table, one line per row, then a summary per split: the share of rows whose published
efficiency lies inside the predicted range, the median |midpoint of the range - published| and the median width
of the range.
"""

import argparse
import csv
import json
import math
import statistics
from pathlib import Path

from src.scaling.cost_fit import fit_line
from src.scaling.cost_model import Compute, Job, Link, Links, predict_step, ring_allreduce_s
from src.scaling.hardware import LINKS
from src.scaling.layer_profile import inspect_network
from src.scaling.published import bounds_for, fit_sync, load_table, predict_published, row_rate
from src.scaling.sources import DEFAULT_CALIBRATION, load_calibration, resolve_compute, resolve_link

LENET = "src.models.classifier.LeNetClassifier"
RESNET = "src.models.classifier.ResNet18Classifier"


def check_allreduce(calibration: str, processes: list[int], repeats: int) -> None:
    """Print measured vs predicted allreduce milliseconds for every P and size (fresh measurements)."""
    from src.scaling.calibrate import CHECK_SIZES, measure_allreduce

    cal = load_calibration(calibration)
    rows = measure_allreduce(processes, repeats)
    print(f"\ncalibration: {calibration} ({cal['date']}, {cal['hardware']})")
    print("| P | buffer | bytes | implementation | measured ms | predicted ms | predicted / measured | goal ±30% |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        for key, name in (("torch", "dist.all_reduce"), ("ring", "our ring")):
            fit = cal["allreduce"][key]
            predicted = ring_allreduce_s(r["p"], r["bytes"], Link(fit["alpha_s"], fit["beta_s_per_byte"]))
            ratio = predicted / r[key]
            goal = ("met" if abs(ratio - 1) <= 0.3 else "not met") if (
                r["p"] == 2 and r["bytes"] in CHECK_SIZES) else "—"
            label = CHECK_SIZES.get(r["bytes"], f"{r['bytes']:,}")
            print(f"| {r['p']} | {label} | {r['bytes']:,} | {name} | {r[key] * 1e3:.3f} | {predicted * 1e3:.3f} "
                  f"| {ratio:.2f} | {goal} |")


def check_epoch(report: str, calibration: str, epoch_images: int) -> None:
    """Print predicted vs measured sec/epoch for each run of a CPU scaling report."""
    links = {"ddp": "gloo-loopback", "split_allreduce_processes": "gloo-loopback-ours", "single": "gloo-loopback"}
    net = inspect_network(LENET) if "lenet" in report else inspect_network(RESNET)
    compute, note = resolve_compute("cpu", net, calibration, None, None)
    print(f"compute: {compute.overhead_s * 1e3:.2f} ms/step + {compute.seconds_per_image * 1e6:.2f} us/image {note}")
    print("| strategy | processes | global batch | measured sec/epoch | predicted sec/epoch | predicted / measured "
          "| goal ±30% |")
    print("|---|---|---|---|---|---|---|")
    for row in csv.DictReader(open(Path(report) / "scaling.csv")):
        if row["strategy"] not in links:
            print(f"| {row['strategy']} | {row['devices']} | {row['global_batch']} | {float(row['sec_per_epoch']):.2f} "
                  "| not modelled (replicas in one process share its threads) | | |")
            continue
        link, _ = resolve_link(links[row["strategy"]], calibration)
        p = predict_step(Job("ring", int(row["devices"]), int(row["global_batch"]), "global", compute,
                             net.gradient_bytes, 2, net.buckets), Links(link))
        predicted = math.ceil(epoch_images / p.global_batch) * p.step_s
        measured = float(row["sec_per_epoch"])
        goal = "met" if abs(predicted / measured - 1) <= 0.3 else "not met"
        if row["strategy"] == "single":  # one process uses both cores; the model's device is one core
            goal = "— (2 threads measured, 1 modelled)"
        print(f"| {row['strategy']} | {row['devices']} | {row['global_batch']} | {measured:.2f} | {predicted:.2f} "
              f"| {predicted / measured:.2f} | {goal} |")


def check_d2l() -> None:
    """Print d2l.ai's two-GPU figures next to the model's predictions from their one-GPU figures.

    A sanity check: the overhead is fitted on the same chapters' one-GPU times, so only the two-GPU column
    is predicted, and from inputs taken from the same source.
    """
    lenet, resnet = inspect_network(LENET), inspect_network(RESNET)
    steps = math.ceil(60_000 / 256)  # d2l.ai trains on all 60,000 images, batch 256 on one GPU
    t_lenet, t_resnet = 2.5 / steps, 13.2 / steps
    # assumed: both chapters' loops pay the same per-step overhead; a line through their one-GPU steps in
    # (FLOPs per step, seconds) then separates overhead from arithmetic, as for our H100
    overhead, s_per_flop = fit_line([(256 * lenet.train_flops_per_image, t_lenet),
                                     (256 * resnet.train_flops_per_image, t_resnet)])
    print("sanity check, not validation: d2l.ai's figures (ResNet-18: MXNet), overhead fitted on the same chapters' "
          "one-GPU times")
    print(f"assumed: the same per-step overhead in both chapters -> {overhead * 1e3:.2f} ms/step, "
          f"{1e-12 / s_per_flop:.1f} TFLOP/s of arithmetic; PCIe 3.0 x16 "
          f"({LINKS['pcie3'].bandwidth_bytes_s / 1e9:.2f} GB/s line rate, alpha {LINKS['pcie3'].alpha_s * 1e6:.0f} "
          "us assumed), reduce to GPU 0 then broadcast, no overlap")
    pcie3 = LINKS["pcie3"].line_link()
    cases = [
        # name, network, one-GPU sec/epoch, batch per device (weak) or global, mode, messages, d2l's 2-GPU figure
        ("ResNet-18, MXNet gluon (batch 256 -> 512)", resnet, 13.2, 256, "per_device",
         math.ceil(resnet.gradient_bytes / 10_485_760), "7.3 (PyTorch version: 9.1)"),
        ("ResNet-18, from the 13.9 s figure", resnet, 13.9, 256, "per_device",
         math.ceil(resnet.gradient_bytes / 10_485_760), "7.3 (PyTorch version: 9.1)"),
        ("LeNet, from scratch (batch 256 both)", lenet, 2.5, 256, "global", 8, "2.5"),
        ("LeNet, if only half its step were overhead", lenet, 2.5, 256, "global", 8, "2.5"),
    ]
    print("| case | 1 GPU sec/epoch (d2l, input) | 2 GPUs d2l sec/epoch | 2 GPUs predicted sec/epoch "
          "| predicted speedup | exchange ms/step | compute ms/step |")
    print("|---|---|---|---|---|---|---|")
    for name, net, one_gpu, batch, mode, messages, published in cases:
        t_step = one_gpu / steps
        fixed = t_step / 2 if name.startswith("LeNet, if") else overhead  # sensitivity to the assumption
        compute = Compute(fixed, (t_step - fixed) / 256)
        two = predict_step(Job("reduce_broadcast", 2, batch, mode, compute, net.gradient_bytes, 8, messages),
                           Links(pcie3))
        predicted = math.ceil(60_000 / two.global_batch) * two.step_s
        print(f"| {name} | {one_gpu} | {published} | {predicted:.2f} | {one_gpu / predicted:.2f} "
              f"| {two.exchange_s * 1e3:.2f} | {two.compute_s * 1e3:.2f} |")


def check_published() -> dict[str, dict[str, float]]:
    """Print the table and summary; return {split: {"rows", "inside", "median_error", "median_width"}}."""
    print("| split | row | network | system | precision | GPUs | published | predicted range | midpoint "
          "| point | inside |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    results: dict[str, list[tuple[bool, float, float]]] = {}
    for r in load_table():
        band = predict_published(r, bounds_for(r.precision_class, row_rate(r)))
        low, high = band.low.efficiency, band.high.efficiency
        mid = (low + high) / 2
        inside = low <= r.efficiency <= high
        results.setdefault(r.split, []).append((inside, abs(mid - r.efficiency), high - low))
        precision = r.precision if r.precision_class else f"{r.precision} (as unknown)"
        print(f"| {r.split} | {r.id} | {r.network} | {r.system} | {precision} | {r.gpus} | {r.efficiency:.3f} "
              f"| {low:.3f}–{high:.3f} | {mid:.3f} | {band.point.efficiency:.3f} | {'yes' if inside else 'no'} |")
    print()
    fit = fit_sync()
    rates = sorted(row_rate(r) for r in load_table())
    for name, intercept in fit.intercepts:
        own = [x for kind, x, _ in fit.implied if kind == name]
        ends = ", ".join(f"{lo:.2%} to {hi:.2%} at {rate:.3f} GB/s"
                         for rate in (rates[0], rates[-1]) for _, lo, hi in [fit.interval(name, rate)])
        print(f"sync overhead, {name}: {intercept:.2%} + {fit.slope:.2%} per GB/s of gradient rate ({len(own)} "
              f"calibration rows at {min(own):.3f} to {max(own):.3f} GB/s; spread {fit.spread:.2%}, t {fit.t:.3f}): "
              f"{ends}")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    a = sub.add_parser("allreduce")
    a.add_argument("--processes", default="[2, 3, 4]")
    a.add_argument("--repeats", type=int, default=7)
    e = sub.add_parser("epoch")
    e.add_argument("report", help="a scaling report folder, e.g. logs/scaling/lenet/version_0")
    e.add_argument("--epoch_images", type=int, default=59_000, help="configs/lenet.yaml holds out 1,000")
    sub.add_parser("d2l")
    sub.add_parser("published")
    for p in (a, e):
        p.add_argument("--calibration", default=DEFAULT_CALIBRATION)
    args = parser.parse_args()
    if args.what == "allreduce":
        check_allreduce(args.calibration, json.loads(args.processes), args.repeats)
    elif args.what == "epoch":
        check_epoch(args.report, args.calibration, args.epoch_images)
    elif args.what == "d2l":
        check_d2l()
    else:
        check_published()


if __name__ == "__main__":
    main()
