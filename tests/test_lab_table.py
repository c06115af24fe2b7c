"""benchmarks/lab_table.py: the compute fit (the line through the one-core step times, never a negative fixed cost)
and the layouts that split the model."""

import pytest

from benchmarks.lab_table import compute_fit


def test_two_points_on_a_line_with_a_fixed_cost_give_that_line():
    overhead, per_image, how = compute_fit(256, 0.002 + 128 * 0.0004, 0.002 + 256 * 0.0004)
    assert overhead == pytest.approx(0.002) and per_image == pytest.approx(0.0004)
    assert how == "the line through B / 2 and B"


def test_a_negative_fixed_cost_is_refused_for_a_line_through_the_origin():
    # 2026-11-27's one-core medians gave -22 ms per step + 0.445 ms per image: B / 2 faster than its share
    t_half, t_full = -0.022 + 128 * 0.000445, -0.022 + 256 * 0.000445
    overhead, per_image, how = compute_fit(256, t_half, t_full)
    assert overhead == 0.0
    # least squares through the origin: sum(b t) / sum(b^2), between the two points' own per-image times
    assert per_image == pytest.approx((128 * t_half + 256 * t_full) / (128**2 + 256**2))
    assert t_half / 128 < per_image < t_full / 256
    assert "-22.0 ms/step" in how


def test_the_split_ways_run_their_overlays_and_are_predicted_by_the_three_ways_forecast():
    """`pipeline gpipe`, `pipeline 1f1b` and `tensor` run the pipeline and tensor-parallel overlays (the pipeline cut
    where the forecast is told it is), and their bytes and steps come from the three ways' forecast: at LeNet's cut,
    features.3, every sample's 20 x 13 x 13 activation goes forward and its gradient back (256 samples a step in
    the lab); a slower link makes every split layout's step longer."""
    from benchmarks.lab_table import layout_args, sent_bytes, split_predicted

    assert layout_args("pipeline 1f1b", "resnet18") == [
        "--config", "configs/strategy/pipeline_cpu.yaml", "--layout.schedule", "1f1b", "--layout.cuts", "[stages.2]"]
    assert layout_args("tensor") == ["--config", "configs/strategy/tensor_parallel_cpu.yaml"]
    # rank 1 sends the gradients back and the logits' broadcast (256 x 10 x 4 bytes)
    assert sent_bytes("lenet", "pipeline gpipe") == 256 * 20 * 13 * 13 * 4 + 256 * 10 * 4
    for name in ("pipeline gpipe", "tensor"):
        fast, slow = (split_predicted("lenet", name, rate, 0.002, 4e-4) for rate in ("1gbit", "100mbit"))
        assert slow.step_s > fast.step_s > 0 and fast.hidden_s == 0
    with pytest.raises(SystemExit, match="or is 'pipeline gpipe', 'pipeline 1f1b' or 'tensor'"):
        layout_args("pipeline zbv")
