"""tests/planted_bugs.py still applies to the reference as it is today.

Grading every plant takes about an hour (run the tool for that); this only
checks that each edit can be made: its file exists, its ``old`` snippet
occurs exactly once there and in the solved starter the tool plants it in,
and it changes something. It also checks that every phase with lab regions
has at least three plants.
"""

from __future__ import annotations

from collections import Counter

import pytest
from planted_bugs import PLANTS, REPO, solved_starter

from mini_vllm.grading import regions


@pytest.mark.parametrize("plant", PLANTS, ids=lambda p: f"{p.phase}-{p.what[:40]}")
def test_every_plant_applies_once(plant):
    path = REPO / plant.path
    assert plant.path.startswith("mini_vllm/"), plant.path
    assert path.is_file(), f"{plant.path} does not exist"
    assert plant.new != plant.old, plant.what
    count = path.read_text().count(plant.old)
    assert count == 1, f"{plant.path}: the snippet of {plant.what!r} occurs {count} times"
    rel, solved = solved_starter(plant)
    count = solved.count(plant.old)
    assert count == 1, f"solved {rel}: the snippet of {plant.what!r} occurs {count} times"


def test_every_phase_with_labs_has_three_plants():
    per_phase = Counter(p.phase for p in PLANTS)
    short = {phase: per_phase[phase] for phase in regions.phases() if per_phase[phase] < 3}
    assert not short, f"phases with fewer than 3 planted bugs: {short}"
