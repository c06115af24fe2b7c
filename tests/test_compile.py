"""`model.compile`: torch.compile on the network changes neither the arithmetic, nor the checkpoint, nor how
the strategies treat the model. The "aot_eager" backend traces forward and backward through the same
torch.compile machinery as TorchInductor but skips code generation, so these runs take seconds."""

import copy

import pytest
import torch

from src.models.classifier import LeNetClassifier
from src.strategies import SplitAllreduceStrategy
from tests.helpers.runs import assert_replicas_bitwise_equal, ddp, fit, max_param_diff, seeded_model

COMPILED = {"compile": True, "compile_backend": "aot_eager"}


def test_compiled_training_equals_eager_and_keeps_checkpoint_keys(tiny_data_dir):
    eager, _, _ = fit(tiny_data_dir, steps=6)
    compiled, trainer, _ = fit(tiny_data_dir, steps=6, model_kwargs=COMPILED)
    assert "_compiled_net" in compiled.__dict__  # the compiled wrapper really ran the steps
    assert max_param_diff(compiled, eager) <= 1e-9
    assert max_param_diff(compiled, seeded_model(model_kwargs=COMPILED)) > 1e-2  # it left the seeded start
    assert list(compiled.state_dict()) == list(eager.state_dict())  # no "_orig_mod." keys: checkpoints interchange
    assert trainer.callback_metrics["train/loss_epoch"].isfinite()


def test_a_copy_compiles_its_own_network():
    model = LeNetClassifier(**COMPILED)
    x = torch.randn(4, 1, 28, 28)
    model(x)
    replica = copy.deepcopy(model)
    assert "_compiled_net" not in replica.__dict__
    with torch.no_grad():
        for p in replica.parameters():
            p.mul_(-1.0)
    assert not torch.allclose(replica(x), model(x))  # the copy runs its own (negated) weights
    assert replica.__dict__["_compiled_net"]._orig_mod is replica.net


@pytest.mark.slow  # starts two DDP processes
def test_compiled_replicas_and_ddp_equal_single_device(tiny_data_dir):
    single, _, _ = fit(tiny_data_dir, steps=6, batch_size=32)
    ours, _, snap = fit(tiny_data_dir, SplitAllreduceStrategy(devices=["cpu", "cpu"]), steps=6, batch_size=32,
                        model_kwargs=COMPILED)
    assert_replicas_bitwise_equal(snap, 2)
    assert max_param_diff(ours, single) <= 1e-9
    theirs, _, _ = fit(tiny_data_dir, ddp(), devices=2, steps=6, batch_size=32, model_kwargs=COMPILED)
    assert max_param_diff(theirs, single) <= 1e-9
