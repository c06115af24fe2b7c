"""benchmarks/lab_table.py's compute fit: the line through the one-core step times, never a negative fixed cost."""

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
