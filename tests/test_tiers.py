"""The suite's own rules: every test declares its tier, and a fast test runs
in pytest's process only."""

import subprocess
import types

import pytest

import conftest
import support

pytestmark = pytest.mark.fast


class Item:
    def __init__(self, nodeid, *markers):
        self.nodeid, self.markers = nodeid, [types.SimpleNamespace(name=m) for m in markers]

    def iter_markers(self):  # the test's own markers first, then its module's
        return iter(self.markers)


class Config:
    def __init__(self, tier=None):
        self.tier, self.deselected = tier, []
        self.hook = types.SimpleNamespace(pytest_deselected=lambda items: self.deselected.extend(items))

    def getoption(self, name):
        return self.tier


def test_a_test_without_a_tier_stops_the_run():
    items = [Item("tests/test_a.py::test_declared", "fast"), Item("tests/test_a.py::test_new", "parametrize")]
    with pytest.raises(pytest.UsageError, match=r"1 test\(s\) declare no tier, e.g. tests/test_a.py::test_new"):
        conftest.pytest_collection_modifyitems(Config(), items)


def test_a_tests_own_marker_decides_over_its_modules():
    own_slow = Item("b", "slow", "fast")  # @pytest.mark.slow in a module marked fast
    items = [Item("a", "fast"), own_slow, Item("c", "parametrize", "fast")]
    config = Config("fast")
    conftest.pytest_collection_modifyitems(config, items)
    assert [i.nodeid for i in items] == ["a", "c"] and config.deselected == [own_slow]


def test_a_fast_test_that_starts_a_process_fails():
    with pytest.raises(AssertionError, match="starts a process: mark it @pytest.mark.slow"):
        subprocess.run(["true"])
    with pytest.raises(AssertionError, match="starts a process"):
        support.cli("fairseq-train", "--help")
