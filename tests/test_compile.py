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
    assert "_compiled_step" in compiled.__dict__  # the compiled network and loss really ran the steps
    assert max_param_diff(compiled, eager) <= 1e-9
    assert max_param_diff(compiled, seeded_model(model_kwargs=COMPILED)) > 1e-2  # it left the seeded start
    assert list(compiled.state_dict()) == list(eager.state_dict())  # no "_orig_mod." keys: checkpoints interchange
    assert trainer.callback_metrics["train/loss_epoch"].isfinite()


def test_a_copy_compiles_its_own_network():
    model = LeNetClassifier(**COMPILED)
    x, y = torch.randn(4, 1, 28, 28), torch.arange(4)
    model(x)
    model._logits_and_loss(x, y)
    replica = copy.deepcopy(model)
    assert "_compiled_net" not in replica.__dict__ and "_compiled_step" not in replica.__dict__
    with torch.no_grad():
        for p in replica.parameters():
            p.mul_(-1.0)
    assert not torch.allclose(replica(x), model(x))  # the copy runs its own (negated) weights
    assert replica.__dict__["_compiled_net"]._orig_mod is replica.net
    (logits, loss), (theirs, their_loss) = replica._logits_and_loss(x, y), model._logits_and_loss(x, y)
    assert not torch.allclose(logits, theirs) and torch.allclose(logits, replica(x))
    assert replica.__dict__["_compiled_step"]._orig_mod.net is replica.net
    assert torch.allclose(loss, replica.loss_fn(replica(x), y)) and not torch.allclose(loss, their_loss)


def test_the_compiled_loss_and_its_gradients_equal_eager():
    """With `compile` on, training runs the network and its loss as one compiled region: the same logits, loss and
    gradients as eager, in float64."""
    torch.manual_seed(0)
    eager = LeNetClassifier(label_smoothing=0.1).double()
    compiled = copy.deepcopy(eager)
    compiled.hparams.compile, compiled.hparams.compile_backend = True, "aot_eager"
    x, y = torch.randn(8, 1, 28, 28, dtype=torch.float64), torch.arange(8) % 10
    outputs = []
    for model in (eager, compiled):
        logits, loss = model._logits_and_loss(x, y)
        loss.backward()
        outputs.append((logits, loss, [p.grad for p in model.parameters()]))
    assert "_compiled_step" in compiled.__dict__ and "_compiled_step" not in eager.__dict__
    (a, la, ga), (b, lb, gb) = outputs
    assert (a - b).abs().max() < 1e-12 and abs(la.item() - lb.item()) < 1e-12
    assert max((g - h).abs().max().item() for g, h in zip(ga, gb)) < 1e-12


@pytest.mark.slow  # starts two DDP processes
def test_compiled_replicas_and_ddp_equal_single_device(tiny_data_dir):
    single, _, _ = fit(tiny_data_dir, steps=6, batch_size=32)
    ours, _, snap = fit(tiny_data_dir, SplitAllreduceStrategy(devices=["cpu", "cpu"]), steps=6, batch_size=32,
                        model_kwargs=COMPILED)
    assert_replicas_bitwise_equal(snap, 2)
    assert max_param_diff(ours, single) <= 1e-9
    theirs, _, _ = fit(tiny_data_dir, ddp(), devices=2, steps=6, batch_size=32, model_kwargs=COMPILED)
    assert max_param_diff(theirs, single) <= 1e-9
