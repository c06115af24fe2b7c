"""benchmarks/epoch_anatomy.py tags each training step of a real fit with what happened in it."""

from benchmarks import epoch_anatomy
from tests.helpers import cli_args

# the tiny data's 500 training images at batch 50: 10 steps an epoch; last.ckpt every 4 optimizer steps
CALLBACKS = """trainer:
  callbacks:
    - class_path: src.callbacks.EpochReport
    - class_path: src.callbacks.LastCheckpoint
      init_args: {every_n_train_steps: 4}
"""


def test_each_step_is_tagged_with_its_logging_and_its_save(tiny_data_dir, tmp_path):
    config = tmp_path / "callbacks.yaml"
    config.write_text(CALLBACKS)
    lines = epoch_anatomy.main(["--epochs", "2", "--logs", str(tmp_path), "--config", "configs/lenet.yaml",
                                "--config", str(config), *cli_args.data_args(tiny_data_dir, batch_size=50),
                                "--trainer.log_every_n_steps", "4", "--trainer.limit_val_batches", "1",
                                "--trainer.num_sanity_val_steps", "0"])
    epochs = epoch_anatomy.Anatomy.epochs
    assert [len(e["steps"]) for e in epochs] == [10, 10]

    def where(tag):
        return [[i for i, (_, tags) in enumerate(e["steps"]) if tag in tags] for e in epochs]

    assert where("first") == [[0], [0]] and where("last") == [[9], [9]]
    # Lightning logs when the count of optimizer steps, this one included, is a multiple of 4: steps 4, 8 | 12, 16, 20
    assert where("logging") == [[3, 7], [1, 5, 9]]
    # a save after step 4 (8, 12, 16) runs after this callback's on_train_batch_end, so it is in the next step's time
    assert where("save") == [[4, 8], [2, 6]]
    # the saves at each epoch's end (and after step 20) fall between the epochs; validation ran in each epoch
    assert epochs[0]["gap_s"] is None and epochs[1]["gap_s"] > 0
    assert all(e["validation_s"] > 0 for e in epochs)
    assert len(lines) == 4 and lines[2].startswith("| 0 | 10 | ")
