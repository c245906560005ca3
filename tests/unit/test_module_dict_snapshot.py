"""A teardown reads module dicts that other threads of the actor may grow meanwhile."""

from __future__ import annotations

import pytest

from raytrain_dt.worker.layout_release import _snapshot


class _GrowingDict(dict):
    """A dict whose first `changes` reads fail as Python's do when another thread inserts
    a key during the iteration (and the insert happens)."""

    def __init__(self, changes: int, **items):
        super().__init__(**items)
        self.changes = changes

    def items(self):
        if self.changes:
            self.changes -= 1
            self[f"imported_{self.changes}"] = object()
            raise RuntimeError("dictionary changed size during iteration")
        return super().items()


def test_a_dict_changed_during_the_read_is_read_again():
    modules = _GrowingDict(2, a=1)
    items = dict(_snapshot(modules))
    assert set(items) == {"a", "imported_1", "imported_0"} and modules.changes == 0


def test_a_dict_that_never_settles_raises_after_the_attempts():
    with pytest.raises(RuntimeError, match="changed size"):
        _snapshot(_GrowingDict(5, a=1), attempts=3)
