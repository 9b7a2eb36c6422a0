"""The shared Registry: order, duplicates, and unknown names."""

import pytest

from fedge.registry import Registry

pytestmark = pytest.mark.timeout(30)


class NotFound(ValueError):
    pass


def test_registry():
    reg: Registry[int] = Registry("widget", NotFound)
    reg.register("b")(2)
    reg.add("a", 1)
    assert list(reg) == ["b", "a"] and reg.get("a") == 1 and "b" in reg and len(reg) == 2
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        reg.add("a", 3)
    with pytest.raises(NotFound, match="unknown widget 'c'; available: b, a"):
        reg.get("c")
    assert reg.remove("b") == 2 and list(reg) == ["a"]
    with pytest.raises(NotFound, match="unknown widget 'b'"):
        reg.remove("b")
