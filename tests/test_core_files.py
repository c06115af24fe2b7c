"""The core at a glance: one default training step of ours (1 process x 2 replicas, LeNet) runs code in at most 9
files of the strategy side, and docs/code-map.md lists exactly those, in the order the step first calls into each,
and what the in-process options add. Files follow their roles, not a line count (functions stay under 60 lines:
tests/test_function_size.py)."""

import re

import pytest

from src.cli import main
from tests.helpers.step_files import SRC, StepFiles

CODE_MAP = SRC.parent / "docs" / "code-map.md"
MAX_FILES = 9


def walk_in_code_map() -> list[str]:
    """The files of the numbered list under "One step of ours, file by file" in docs/code-map.md, in its order."""
    section = CODE_MAP.read_text().split("## One step of ours, file by file")[1].split("\n## ")[0]
    return re.findall(r"^\d+\. `(src/[^`]+\.py)`", section, flags=re.MULTILINE)


def option_in_code_map(option: str) -> set[str]:
    """The files that the bullet of `option` (e.g. "overlap: true") under "What each option brings in" names."""
    bullet = CODE_MAP.read_text().split(f"- `{option}`:")[1].split("\n- ")[0].split("\n\n")[0]
    return set(re.findall(r"`(src/[^`]+\.py)`", bullet))


def traced_step_files(fast_args: list[str], *overrides: str) -> set[str]:
    """The strategy-side files of steps 3 to 5 of ours, 1 process x 2 replicas, LeNet, with `overrides`."""
    StepFiles.seen = set()
    main(["fit", "--config", "configs/lenet.yaml", "--config", "configs/strategy/split_allreduce.yaml", *fast_args,
          "--trainer.limit_train_batches", "5", "--trainer.num_sanity_val_steps", "0", "--test_after_fit", "false",
          "--trainer.callbacks+=tests.helpers.step_files.StepFiles", *overrides])
    return StepFiles.seen


def test_a_default_step_of_ours_runs_in_at_most_9_files_which_the_code_map_lists(fast_args):
    seen = traced_step_files(fast_args)
    assert "src/strategies/split_allreduce.py" in seen and "src/strategies/comm/allreduce.py" in seen, seen
    assert len(seen) <= MAX_FILES, sorted(seen)
    assert walk_in_code_map() == StepFiles.order  # the same files, in the order the step first calls into them


@pytest.mark.parametrize("option, override", [
    ("overlap: true", "--trainer.strategy.init_args.overlap=true"),
    ("split_weights: auto", "--trainer.strategy.init_args.split_weights=auto"),  # fixed at step 5, in the window
    ("zero_stage: 1 | 2", "--trainer.strategy.init_args.zero_stage=1"),
])
def test_the_code_map_says_what_an_in_process_option_adds(fast_args, option, override):
    added = traced_step_files(fast_args, override) - set(walk_in_code_map())
    assert added and added == option_in_code_map(option)
