"""The per-step breakdown as a table: one row per process, medians over the recorded steps, in ms and as a
fraction of the step (markdown for people, CSV for tools). The markdown adds the means over the same steps,
which add up to the mean step where the medians need not."""

import csv
import io

from src.timeline.breakdown import CATEGORIES

COLUMNS = ("step", *CATEGORIES, "hidden_communication", "gpu_busy")
HEADINGS = {"step": "step", "compute": "compute", "communication": "exposed communication",
            "waiting": "waiting", "loop": "loop overhead", "unattributed": "unattributed",
            "hidden_communication": "hidden communication", "gpu_busy": "GPU busy"}


def table_rows(medians: list[dict[str, float]], steps: list[int]) -> list[dict[str, float | int]]:
    """One row per rank: its median ms of every column (`<col>_ms`) and fraction of the median step
    (`<col>_fraction`), with `rank` and the number of `steps` the medians are over."""
    rows = []
    for rank, (median, n) in enumerate(zip(medians, steps)):
        row: dict[str, float | int] = {"rank": rank, "steps": n}
        for col in COLUMNS:
            row[f"{col}_ms"] = round(median[col], 3)
            row[f"{col}_fraction"] = round(median[col] / median["step"], 4) if median["step"] else 0.0
        rows.append(row)
    return rows


MEDIANS_NOTE = ("Each median is taken column by column over the recorded steps, so the categories' medians need "
                "not add up to the median step: the median of a sum is not the sum of the medians. The means "
                "below do add up (compute + exposed communication + waiting + loop overhead + unattributed = "
                "step, up to rounding), since every step's categories sum to its length.")


def markdown(rows: list[dict[str, float | int]], title: str,
             mean_rows: list[dict[str, float | int]] | None = None) -> str:
    """A markdown table: "ms (percent of the step)" per category, one line per rank; then `MEDIANS_NOTE` and,
    if given, the same table of the means over the same steps.

    Args:
        rows: `table_rows` of the medians.
        title: The run, in bold above the table.
        mean_rows: `table_rows` of the means (`src.timeline.breakdown.mean_row`); None leaves that table out.
    """
    lines = _table(rows, f"**{title}** (median over the recorded steps; ms, and % of the step)")
    lines += ["", MEDIANS_NOTE]
    if mean_rows is not None:
        lines += ["", *_table(mean_rows, "**Means** over the same steps (ms, and % of the mean step)")]
    return "\n".join(lines) + "\n"


def _table(rows: list[dict[str, float | int]], heading: str) -> list[str]:
    """The lines of one markdown table of `table_rows`, under `heading`."""
    head = ["rank", "steps", *(HEADINGS[c] for c in COLUMNS)]
    lines = [heading, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [str(row["rank"]), str(row["steps"]), f"{row['step_ms']:.1f}"]
        cells += [f"{row[f'{c}_ms']:.1f} ({100 * row[f'{c}_fraction']:.0f}%)" for c in COLUMNS[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def csv_text(rows: list[dict[str, float | int]]) -> str:
    """The rows as CSV with a header line."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()
