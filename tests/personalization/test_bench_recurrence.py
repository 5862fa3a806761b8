"""`astec personalize bench`'s with / without recurrence table: the two policies paired on the
same held-out visits, clustered by user, and refused when their visits differ."""

import click
import numpy as np
import pytest

from personalization.cli_bench_policy import recurrence_table


def _run(users, served, greedy):
    return {
        "world_seed": 40,
        "train_seed": 0,
        "gru_per_visit": {"user": users, "served_ctr": served, "actual_ctr": greedy},
    }


def test_the_table_pairs_the_two_policies_visit_by_visit():
    rng = np.random.default_rng(0)
    users = rng.integers(0, 50, 2000).tolist()
    base = rng.uniform(0.05, 0.15, 2000)
    full = _run(users, (base + 0.01).tolist(), (base + 0.012).tolist())
    same = _run(users, base.tolist(), base.tolist())
    row = recurrence_table([full], [same], 200).splitlines()[-1].split("|")
    cells = [c.strip() for c in row[1:-1]]
    assert cells[:2] == ["40", "0"]
    assert float(cells[4]) == pytest.approx((base.mean() + 0.01) / base.mean(), abs=1e-3)
    # a constant gain on every visit: the paired lower bound is the gain itself, above zero
    assert float(cells[5]) == pytest.approx(0.01, abs=1e-4)
    assert float(cells[7]) == pytest.approx(0.012, abs=1e-4)
    # no gain: ratio 1, lower bound 0
    row = recurrence_table([same], [same], 200).splitlines()[-1].split("|")
    assert float(row[5]) == pytest.approx(1.0) and float(row[6]) == pytest.approx(0.0)


def test_reports_of_different_visits_are_refused():
    a = _run([1, 2, 3], [0.1, 0.1, 0.1], [0.1, 0.1, 0.1])
    b = _run([1, 2, 4], [0.1, 0.1, 0.1], [0.1, 0.1, 0.1])
    with pytest.raises(click.ClickException, match="different visits"):
        recurrence_table([a], [b], 50)
