"""The forecast's assumption lines that do not depend on the question's numbers alone: the network, the sync overhead,
the jitter and the exchange, each with where its figures come from (docs/forecast.md, "Where the numbers come from").
"""

from src.scaling.cost_fit import Bounds
from src.scaling.model_counts import Network
from src.scaling.published import JITTER, LEVEL, fit_sync


def network_note(net: Network, custom: bool, messages: int) -> str:
    """The assumption line about the network: its size, its gradients and where the numbers come from."""
    source = ("[user: --network_params, --grad_bytes]" if custom else
              f"[measured: counted from the model]; {net.train_flops_per_image / 1e9:.4f} GFLOP per training image "
              "(conv + dense, backward = 2x forward)")
    return (f"network: {net.class_name}, {net.parameters:,} parameters, {net.gradient_bytes:,} bytes of "
            f"{'/'.join(net.gradient_dtypes)} gradients per replica in {messages} allreduce call(s) per step "
            + source)


def sync_note(user_overhead: float | None, precision: str | None, bounds: Bounds) -> str:
    """The assumption line about the sync overhead: the user's figure, or the fitted range for `precision`."""
    what = "sync overhead (data-parallel hooks and bucket copies, processes sharing one host)"
    if user_overhead is not None:
        return f"{what}: {user_overhead:.1%} of the compute once devices > 1 [user: --sync_overhead]"
    fits = "; ".join(f"{f.precision}: {f.bounds[0]:.1%} to {f.bounds[1]:.1%} (mean {f.mean:.1%} of "
                     f"{len(f.implied)} rows)" for f in fit_sync().values())
    return (f"{what}, precision {precision or 'unknown (both kinds)'}: {bounds.sync_overhead[0]:.1%} to "
            f"{bounds.sync_overhead[1]:.1%} of the compute once devices > 1 [published: fitted on the calibration "
            f"rows of src/scaling/calibration/published_scaling.csv, a {LEVEL:.0%} prediction interval per kind: "
            f"{fits}]")


JITTER_NOTE = (f"slowest-rank jitter: each rank's step varies by {JITTER[0]:.1%} to {JITTER[1]:.1%} (standard "
                "deviation) and the step waits for the slowest, E[max of p normals] x that [assumed: p50 and p95 "
                "step times of https://github.com/pytorch/pytorch/blob/main/benchmarks/distributed/ddp/README.md "
                "differ by 0 to 5%]")
EXCHANGE_NOTE = ("exchange: alpha-beta model (Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009); a flat ring "
                  "across nodes runs at the node's NICs together; the range's low end uses achieved bandwidths, no "
                  "overlap and the upper jitter and sync bounds, its high end line rates, full overlap and the lower "
                  "bounds; network congestion, tree / NVLS algorithms and memory limits are not modelled (the model "
                  "state per device has its own section)")
