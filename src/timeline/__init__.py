"""The step timeline: phase labels the strategies emit while a profiler records, and what is made of the trace
(the per-step breakdown, the picture). `src.callbacks.StepTimeline` runs the profiler and writes the files."""
