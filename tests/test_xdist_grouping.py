"""`make test` runs on two pytest-xdist workers with `--dist loadgroup`, and the
lockstep coverage tests (tests/upstream/test_lockstep.py and its siblings) read
counters their lockstep test left in the same worker process: they rely on
`xdist_group` keeping a group on one worker. This pair fails when it does not
(as happened with pytest 9.x and pytest-xdist 3.8, which is why pyproject pins
pytest 8.4)."""

import pytest

_SEEN: list[str] = []


@pytest.mark.xdist_group("grouping-check")
def test_group_first():
    _SEEN.append("first")


@pytest.mark.xdist_group("grouping-check")
def test_group_second_runs_in_the_same_process(request):
    names = [item.name for item in request.session.items]
    if "test_group_first" not in names:
        pytest.skip("test_group_first was deselected, so there is nothing to compare")
    assert _SEEN == ["first"], (
        "test_group_first ran in another process: xdist_group did not keep the group on one "
        "worker, so every lockstep coverage test would skip"
    )
