"""``make test`` runs ``pytest -n 3 --dist loadgroup``: tests marked ``xdist_group`` share one
worker, so a costly module fixture they read (an 8-device worker process, a trained run) is
computed once, not once per worker. pytest 9.2 broke this silently (pytest-xdist issue 1386: the
group no longer reaches the node id and the tests are spread as if unmarked); pyproject.toml pins
a pytest that keeps it, and this test fails on one that does not."""

import pytest


@pytest.mark.xdist_group("suite_grouping")
def test_loadgroup_keeps_a_group_on_one_worker(request):
    config = request.config
    if not hasattr(config, "workerinput") or config.getoption("dist", "no") != "no":
        pytest.skip("checks make test's run: an xdist worker under --dist loadgroup")
    if not config.getoption("loadgroup", False):
        pytest.skip("this xdist run does not group (--dist is not loadgroup)")
    assert request.node.nodeid.endswith("@suite_grouping"), (
        f"{request.node.nodeid}: pytest {pytest.__version__} dropped the xdist_group suffix, so "
        "--dist loadgroup spreads grouped tests over workers; pin the pytest in pyproject.toml"
    )
