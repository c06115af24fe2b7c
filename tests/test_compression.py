"""Gradient compression of the exchange between processes, on one bucket (src/strategies/comm/compression.py),
and what a resume does with its saved state (src/strategies/compression_state.py).

The exchange between processes is replaced by a function that adds a fixed peer buffer, as a second process
would send it, or by the identity (one process), so every figure can be checked by hand.
"""

from pathlib import Path

import pytest
import torch

from src.strategies.comm.compression import (Bf16Compression, PowerSGDCompression, compressed_rank, CompressionSpec,
                                             orthogonalize_)
from src.strategies.comm.process_allreduce import ring_bytes
from src.strategies.compression_state import restore_state
from src.strategies.ddp_compression import CompressedDDPStrategy


def _wire_bytes(numel: int, size: int) -> int:
    return numel * size  # two processes swap whole buffers


def _identity(buffer: torch.Tensor) -> int:
    return buffer.numel() * buffer.element_size()


def _powersgd(rank=2, warmup=0, error_feedback=True, warm_start=True, world=1, min_rate=1.0):
    return PowerSGDCompression(rank, warmup, error_feedback, warm_start, min_rate, world, _wire_bytes)


def test_bf16_rounds_a_known_bucket_and_sums_in_bf16():
    flat = torch.tensor([1 + 2**-8, 3.0, -0.1, 1e-3], dtype=torch.float64)
    peer = torch.tensor([1.0, 0.5, 0.0, 2**-20], dtype=torch.bfloat16)  # what the other process sends

    def between(buffer):
        assert buffer.dtype == torch.bfloat16
        buffer.add_(peer)
        return buffer.numel() * buffer.element_size()

    bf16 = Bf16Compression(_wire_bytes)
    bf16.begin_step()
    sent = bf16.allreduce_(flat, [0], [flat.shape], between)
    # 1 + 2^-8 lies halfway between bf16's neighbours 1 and 1 + 2^-7 and rounds to even (1.0); -0.1 is
    # -0.10009765625 in bf16; 1e-3 rounds to 0.00099945068359375 and adding 2^-20 in bf16 leaves it there
    assert flat.tolist() == [2.0, 3.5, -0.10009765625, 0.00099945068359375]
    assert flat.dtype == torch.float64
    assert sent == bf16.bytes_sent == 4 * 2 and bf16.bytes_uncompressed == 4 * 8


def test_powersgd_reproduces_an_exactly_rank_r_gradient_after_a_warm_started_step():
    torch.manual_seed(0)
    conv = (6, 3, 2, 2)  # a conv weight: the matrix (6, 12)
    compression = _powersgd(rank=2)
    for step in range(2):  # the second step starts from the first one's Q (warm start)
        a, b = torch.randn(6, 2, dtype=torch.float64), torch.randn(12, 2, dtype=torch.float64)
        grad, bias = (a @ b.T).reshape(conv), torch.randn(6, dtype=torch.float64)
        flat = torch.cat([grad.reshape(-1), bias])
        compression.begin_step()
        compression.allreduce_(flat, [0, 1], [torch.Size(conv), torch.Size([6])], _identity)
        torch.testing.assert_close(flat[:72].view(conv), grad, rtol=0, atol=1e-12)
        assert torch.equal(flat[72:], bias)  # a vector travels as it is
        if step == 0:
            assert set(compression.q) == {0}
    assert compression.errors[0].abs().max() < 1e-12  # nothing was left out


def test_error_feedback_adds_back_exactly_what_was_left_out():
    """Each step sends (gradient + last error) minus the new error, so the sum of what was sent plus the error
    left at the end is the sum of the gradients: nothing is lost, only delayed."""
    torch.manual_seed(1)
    compression = _powersgd(rank=1)
    grads = [torch.randn(8, 10, dtype=torch.float64) for _ in range(5)]
    sent_total = torch.zeros(8, 10, dtype=torch.float64)
    error = torch.zeros(8, 10, dtype=torch.float64)
    for g in grads:
        flat = g.reshape(-1).clone()
        compression.begin_step()
        compression.allreduce_(flat, [3], [g.shape], _identity)
        out = flat.view(8, 10)
        assert torch.equal(compression.errors[3], (g + error) - out)  # what this step left out, exactly
        assert (compression.errors[3].abs().max()) > 1e-3  # rank 1 of a random 8 x 10 matrix leaves a lot out
        error = compression.errors[3]
        sent_total += out
    torch.testing.assert_close(sent_total + error, torch.stack(grads).sum(0), rtol=0, atol=1e-12)


def test_powersgd_sums_over_two_processes_with_errors_that_add_up_to_what_was_left_out():
    """Two compressors, one per process, exchanging through a fake allreduce that sums both sides' buffers."""
    torch.manual_seed(2)
    grads = [torch.randn(8, 10, dtype=torch.float64) for _ in range(2)]
    procs = [_powersgd(rank=1, world=2) for _ in range(2)]
    flats = [g.reshape(-1).clone() for g in grads]
    for c in procs:
        c.begin_step()
    # run both exchanges in lockstep: each call of `between` waits for the other process's buffer
    import threading
    barrier, slots = threading.Barrier(2), [None, None]

    def between_for(rank):
        def between(buffer):
            slots[rank] = buffer.clone()
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()
            buffer.copy_(total)
            return buffer.numel() * buffer.element_size()
        return between

    threads = [threading.Thread(target=procs[r].allreduce_, args=(flats[r], [0], [grads[r].shape], between_for(r)))
               for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert torch.equal(flats[0], flats[1])  # both processes hold the same approximation of the sum
    left_out = grads[0] + grads[1] - flats[0].view(8, 10)
    torch.testing.assert_close(procs[0].errors[0] + procs[1].errors[0], left_out, rtol=0, atol=1e-12)
    # bytes: (8 + 10) x rank 1 float64 numbers sent, against 80
    assert procs[0].bytes_sent == (8 + 10) * 8 and procs[0].bytes_uncompressed == 80 * 8


def test_powersgd_warm_up_steps_are_exact_and_small_matrices_travel_uncompressed():
    compression = _powersgd(rank=2, warmup=2, min_rate=2.0)
    g = torch.randn(4, 5, dtype=torch.float64)
    for _ in range(2):
        flat = g.reshape(-1).clone()
        compression.begin_step()
        compression.allreduce_(flat, [0], [g.shape], lambda b: b.mul_(2).numel() * 0)
        assert torch.equal(flat, 2 * g.reshape(-1)) and not compression.errors
    assert compressed_rank(torch.Size([4, 5]), 2, 2.0) == 0  # 20 numbers against 18: not worth it
    assert compressed_rank(torch.Size([120, 400]), 2, 2.0) == 2
    assert compressed_rank(torch.Size([10]), 2, 1.0) == 0
    assert compressed_rank(torch.Size([6, 1, 5, 5]), 3, 1.0) == 3  # a conv weight as (6, 25): 93 numbers of 150
    assert compressed_rank(torch.Size([6, 1, 5, 5]), 8, 1.0) == 0  # rank 6 = min(n, m) would send more


def test_orthogonalize_gives_orthonormal_columns_and_keeps_zero_columns_zero():
    p = torch.randn(7, 3, dtype=torch.float64)
    orthogonalize_(p)
    torch.testing.assert_close(p.T @ p, torch.eye(3, dtype=torch.float64), rtol=0, atol=1e-12)
    z = torch.zeros(5, 2, dtype=torch.float64)
    orthogonalize_(z)
    assert torch.equal(z, torch.zeros(5, 2, dtype=torch.float64))


def test_ring_bytes_count_what_each_process_sends():
    assert ring_bytes(1000, 4, 1, 0) == 0
    assert ring_bytes(1000, 4, 2, 1) == 4000  # two processes swap whole buffers
    # three processes: chunks of 334, 333, 333; each rank sends 4 of them over the two phases
    assert sum(ring_bytes(1000, 4, 3, r) for r in range(3)) == 4 * 1000 * 4


@pytest.mark.parametrize("kwargs, message", [(dict(rank=0), "compression.rank must be an integer of at least 1"),
                                             (dict(warmup_steps=-1), "compression.warmup_steps must be an integer"),
                                             (dict(min_compression_rate=0.0),
                                              r"compression.min_compression_rate=0.0: must be a number > 0")])
def test_bad_powersgd_settings_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CompressionSpec("powersgd", **kwargs)


def test_min_compression_rate_below_one_is_taken_as_torch_and_the_ddp_overlay_take_it():
    """One rule for ours and DDP: any number > 0. Below 1 a matrix is compressed even where its factors are larger:
    a (4, 4) gradient at rank 2 is 16 numbers, its factors (4 + 4) x 2 = 16, compressed at 0.5 and not at 1."""
    spec = CompressionSpec("powersgd", rank=2, min_compression_rate=0.5)
    assert isinstance(spec.make(2, _wire_bytes), PowerSGDCompression)
    assert compressed_rank((4, 4), 2, 0.5) == 2 and compressed_rank((4, 4), 2, 1.0) == 0
    CompressedDDPStrategy(compression=spec)  # accepted there too: the same group


def test_unknown_compression_is_refused():
    with pytest.raises(ValueError, match="unknown compression.kind 'fp8'; choose one of none, bf16, powersgd"):
        CompressionSpec("fp8")
    assert CompressionSpec("none").make(2, _wire_bytes) is None
    assert CompressionSpec("powersgd", rank=4).tag == "powersgd-r4"


def _trained(world=2, steps=3):
    """A PowerSGD compression of one process after `steps` compressed steps on a (6, 10) gradient."""
    c = _powersgd(rank=2, world=world)
    for s in range(steps):
        c.begin_step()
        c.allreduce_(torch.randn(60, dtype=torch.float64), [4], [torch.Size([6, 10])], _identity)
    return c


def test_a_resume_takes_back_its_own_error_memory_or_the_sum_on_another_world_size_or_starts_anew():
    torch.manual_seed(3)
    saved_by = [_trained(), _trained()]  # two processes' error memories, as a checkpoint holds them
    saved = saved_by[0].state_dict() | {"world_size": 2, "errors_by_rank": [c.errors for c in saved_by]}
    cpu = torch.device("cpu")

    same = _powersgd(rank=2, world=2)
    line = restore_state(same, saved, 2, 1, cpu)
    assert line == "gradient compression: PowerSGD rank 2 resumed at step 3, each process's error memory back"
    assert same.steps == 3 and torch.equal(same.errors[4], saved_by[1].errors[4]) and same.q.keys() == {4}

    rank0, rank2 = _powersgd(rank=2, world=3), _powersgd(rank=2, world=3)
    line = restore_state(rank0, saved, 3, 0, cpu)
    restore_state(rank2, saved, 3, 2, cpu)
    assert "the error memory of 2 processes summed onto rank 0 of 3" in line
    assert torch.equal(rank0.errors[4], saved_by[0].errors[4] + saved_by[1].errors[4]) and not rank2.errors

    other_rank = _powersgd(rank=4, world=2)
    assert restore_state(other_rank, saved, 2, 0, cpu) == (
        "gradient compression: PowerSGD rank 4 starts anew (the checkpoint's is for PowerSGD rank 2)")
    assert other_rank.steps == 0 and not other_rank.errors
    fresh = _powersgd(rank=2, world=2)
    assert restore_state(fresh, {}, 2, 0, cpu) == (
        "gradient compression: PowerSGD rank 2 starts anew (the checkpoint holds none)")
    assert restore_state(None, saved, 2, 0, cpu) == (
        "gradient compression: the checkpoint's PowerSGD rank 2 state is not used (this run exchanges gradients "
        "uncompressed)")
    assert restore_state(fresh, None, 2, 0, cpu) is None  # a run that starts afresh says nothing


def test_a_compressed_checkpoint_resumed_under_another_strategy_says_its_state_is_not_used(tiny_data_dir, tmp_path,
                                                                                          caplog):
    """Through the CLI: a checkpoint with PowerSGD state resumed on one device trains on, with one line."""
    import logging

    from src.cli import main
    from src.strategies.compression_state import KEY
    from tests.helpers.cli_args import data_args, trainer_args

    args = ["fit", "--config", "configs/lenet.yaml", *data_args(tiny_data_dir), "--test_after_fit", "false"]
    first = main([*args, *trainer_args(tmp_path / "a", train_batches=2)])
    saved = Path(first.trainer.checkpoint_callback.best_model_path)
    checkpoint = torch.load(saved, weights_only=True)
    checkpoint[KEY] = _trained().state_dict() | {"world_size": 2, "errors_by_rank": [{}, {}]}
    torch.save(checkpoint, tmp_path / "compressed.ckpt")
    with caplog.at_level(logging.INFO):
        resumed = main([*args, *trainer_args(tmp_path / "b", max_epochs=2, train_batches=2),
                        "--ckpt_path", str(tmp_path / "compressed.ckpt")])
    assert resumed.trainer.global_step == 4
    assert ("gradient compression: the checkpoint's PowerSGD rank 2 state is not used (this run's strategy does "
            "not read it)") in caplog.text


def test_the_epoch_line_names_our_compression_and_its_bytes():
    from types import SimpleNamespace

    from lightning.pytorch.strategies import SingleDeviceStrategy

    from src.layout import step_counters
    from src.strategies import SplitAllreduceStrategy

    def _compression_bytes(strategy):
        return step_counters(strategy).compression_bytes()

    ours = SplitAllreduceStrategy(devices=["cpu", "cpu"])
    assert _compression_bytes(ours) is None  # before the first step: no exchange yet
    powersgd = CompressionSpec("powersgd", rank=2, warmup_steps=0).make(2, _wire_bytes)
    powersgd.begin_step()
    exchange = SimpleNamespace(compression=powersgd, bytes_sent=[700, 0], bytes_uncompressed=[4000, 0])
    ours.exchange = exchange  # the replicas' exchange after a step
    assert _compression_bytes(ours) == ("PowerSGD rank 2", 700, 4000)
    assert _compression_bytes(SingleDeviceStrategy("cpu")) is None
