"""Draws docs/partitions.png: what each of 3 replicas holds of one bucket before and after each half of the ring
under `zero_stage`, cut where `src.strategies.partitions` cuts it.

    python -m scripts.partition_picture --out docs/partitions.png

The bucket is made up: three parameters of 10, 4 and 9 elements (a weight, its bias in the group without weight
decay, the next weight), so that the chunks of 8, 8 and 7 elements cross parameters and groups as real ones do.
"""

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

from src.strategies.comm.allreduce import owned_chunk  # noqa: E402
from src.strategies.partitions import chunk_bounds, owned_segments  # noqa: E402

NAMES, NUMELS, K = ["fc1.weight", "fc1.bias", "fc2.weight"], [10, 4, 9], 3
COLOURS = {"local gradient": "#BBBBBB", "partial sum (not used)": "#E8E8E8", "reduced gradient": "#C44E52",
           "updated parameters": "#55A868", "parameters": "#4C72B0", "optimizer state": "#DD8452"}
PANELS = ["after backward:\neach replica's own gradient",
          "after the reduce-scatter:\nreplica r holds chunk (r+1) mod 3",
          "the update: replica r steps its chunk\nwith its own optimizer state",
          "after the all-gather of the parameters:\nevery replica whole again"]


def _cells(panel: int, replica: int, element: int) -> str:
    """What replica `replica` holds of `element` in `panel`."""
    first, last = chunk_bounds(sum(NUMELS), K, owned_chunk(replica, K))
    owned = first <= element < last
    if panel == 0:
        return "local gradient"
    if panel == 1:
        return "reduced gradient" if owned else "partial sum (not used)"
    if panel == 2:
        return "updated parameters" if owned else "parameters"
    return "updated parameters"


def draw(out: str) -> None:
    """Write the picture to `out` (PNG), making its folder if needed."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    total = sum(NUMELS)
    fig, axes = plt.subplots(1, len(PANELS), figsize=(17, 3.6))
    for panel, ax in enumerate(axes):
        for r in range(K):
            y = K - 1 - r
            for e in range(total):
                ax.add_patch(Rectangle((e, y + 0.15), 1, 0.6, facecolor=COLOURS[_cells(panel, r, e)],
                                       edgecolor="white", linewidth=0.5))
            if panel == 2:  # the optimizer state each replica keeps: its chunk's only
                for s in owned_segments([0, 1, 2], NUMELS, r, K):
                    start = sum(NUMELS[:s.param]) + s.start
                    ax.add_patch(Rectangle((start, y + 0.0), s.numel, 0.12, facecolor=COLOURS["optimizer state"]))
            ax.text(-0.5, y + 0.45, f"replica {r}", ha="right", va="center", fontsize=9)
        edge = 0
        for name, n in zip(NAMES, NUMELS):  # where the parameters start and end
            ax.axvline(edge, color="black", linewidth=0.8)
            ax.text(edge + n / 2, K + 0.05, name, ha="center", va="bottom", fontsize=8)
            edge += n
        ax.axvline(edge, color="black", linewidth=0.8)
        ax.set_xlim(-0.2, total + 0.2)
        ax.set_ylim(-0.2, K + 0.5)
        ax.set_title(PANELS[panel], fontsize=10)
        ax.axis("off")
    fig.legend(handles=[Patch(facecolor=c, label=n) for n, c in COLOURS.items()], loc="lower center", ncol=6,
               fontsize=9, frameon=False)
    fig.suptitle("zero_stage 1 and 2 on 3 replicas: one bucket of 23 elements, cut into ring chunks of 8, 8 and 7",
                 fontsize=11)
    fig.tight_layout(rect=(0.03, 0.08, 1, 0.93))
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/partitions.png", help="the PNG to write")
    draw(parser.parse_args().out)
