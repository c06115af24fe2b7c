"""Run plumbing around training: error messages, launch checks, checkpoint files, run naming, the few private
Lightning touches and process-group cleanup. No data parallelism happens here."""
