"""The goodput lab's table, reproduced by healthd-sim: each of the lab's seven scenarios (20 seeds, 28
days) within 1.5 points of the lab's published goodput, scored by healthd.goodput.

The lab's own figures are means over its seeds 1-20, with its own random numbers. Where a scenario's
runs spread widely, a 20-seed mean moves by more than 1.5 points from one set of seeds to the next: no
spares (p10-p90 of 22-48 %) has a standard error of 2.3 points over 20 seeds, the firmware regression
1.0. For those two the mean is taken over more seeds (seeds 1-200 and 1-100), which estimates what the
model gives rather than what one set of 20 seeds drew (docs/sim.md: the reproduction table)."""

from __future__ import annotations

import statistics

import pytest

from healthd.sim import engine, scenario

LAB = {
    "baseline": 79.6,
    "daly-interval": 85.1,
    "async-checkpoint": 91.7,
    "fast-hang-detection": 80.6,
    "no-spares": 36.1,
    "firmware-regression": 73.5,
    "combined": 94.0,
}
SEEDS = {"no-spares": 200, "firmware-regression": 100}


@pytest.mark.parametrize("name", list(LAB))
def test_each_lab_scenario_within_one_and_a_half_points(name):
    s = scenario.load(name)
    runs = [engine.run(s, seed) for seed in range(1, SEEDS.get(name, 20) + 1)]
    assert all(r.partial == () for r in runs)
    mean = statistics.fmean(r.goodput for r in runs) * 100
    assert abs(mean - LAB[name]) <= 1.5, f"{name}: {mean:.2f} % against the lab's {LAB[name]} %"


def test_the_lab_intervals_are_young_and_daly_from_the_nominal_mtbi():
    s = scenario.load("daly-interval")
    assert s.nominal_mtbi_hours() == pytest.approx(14.78, abs=0.01)
    assert s.interval_seconds() / 60 == pytest.approx(91, abs=0.5)
    assert scenario.load("async-checkpoint").interval_seconds() / 60 == pytest.approx(29.4, abs=0.1)
