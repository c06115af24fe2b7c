"""Phase labels for the step timeline: `torch.profiler.record_function` spans, emitted only while it records.

Every label starts with `dp/`. A label naming a replica (`dp/replica 1/forward`) belongs to that replica's lane;
`dp/stage s/forward i` (also `backward i`, `backward weight i`) is a pipeline stage's work on micro-batch i and
belongs to that stage's lane; the others (`dp/scatter`, `dp/backward (all replicas)`, `dp/allreduce bucket 0`,
`dp/wait/global batch size`) belong to the whole process. The code that computes always enters them; whether a
timeline records only decides whether they make a span, never what runs.
`src.timeline.breakdown.category_of` says which category each label counts towards.

When no timeline records (the default), `phase` returns one shared `nullcontext`: no `record_function` object
is made, so the labels cost one global lookup each.
"""

from contextlib import AbstractContextManager, nullcontext

from torch.profiler import record_function

PREFIX = "dp/"
#: the span around a pipeline schedule's step (`src.strategies.pipeline_net`): inside it, what no stage's compute or
#: a collective covers is the stage waiting for another (the pipeline's bubble), hence a `wait/` label
PIPELINE_WAIT = "wait/pipeline schedule"
_OFF = nullcontext()
_recording = False


def phase(name: str) -> AbstractContextManager:
    """A span called `dp/<name>` in the trace while a timeline records; a no-op otherwise."""
    return record_function(PREFIX + name) if _recording else _OFF


def replica_phase(k: int, what: str) -> AbstractContextManager:
    """`phase("replica <k>/<what>")`: replica k's forward, backward or optimizer."""
    return record_function(f"{PREFIX}replica {k}/{what}") if _recording else _OFF


def recording() -> bool:
    """Whether a step timeline is recording now (in this process)."""
    return _recording


def set_recording(on: bool) -> None:
    """Turn the labels on (a timeline's window starts) or off (it ends)."""
    global _recording
    _recording = on
