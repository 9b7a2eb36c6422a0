"""fedge.plugins: methods found through `fedge.methods` entry points of installed distributions (here: dist-info
folders on sys.path, what pip writes), their halves loaded apart, and every malformed or broken declaration refused
with a message that names the distribution and what to do; the registries load once, on first read."""

import sys

import pytest

from fedge.plugins import PluginError, load_methods, method_entry_points, package_attributes
from fedge.registry import Registry

pytestmark = pytest.mark.timeout(60)


def install(site, dist, entries, files):
    """A distribution `dist` in `site` as pip would leave it: its files, and a dist-info with `entries`
    (name → value) in the fedge.methods group."""
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = "".join(f"{name} = {value}\n" for name, value in entries.items())
    (info / "entry_points.txt").write_text(f"[fedge.methods]\n{lines}")
    for path, text in files.items():
        (site / path).parent.mkdir(parents=True, exist_ok=True)
        (site / path).write_text(text)


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("plugtest_")]:
        del sys.modules[name]


def test_a_client_only_method_loads_its_client_half_and_no_server_half(site):
    install(
        site,
        "plugtest-a",
        {"plugtest_a": "plugtest_a"},
        {"plugtest_a/__init__.py": "FLEETS = 1\n", "plugtest_a/client.py": "LOADED = True\n"},
    )
    assert "plugtest_a" in {ep.name for ep in method_entry_points()}
    assert "plugtest_a.server" not in load_methods("server") and "plugtest_a.client" not in sys.modules
    assert "plugtest_a.client" in load_methods("client") and sys.modules["plugtest_a.client"].LOADED
    assert package_attributes("FLEETS") == {"plugtest_a": 1}


def test_a_method_that_fails_to_import_is_named_with_what_to_do(site):
    install(
        site,
        "plugtest-broken",
        {"plugtest_b": "plugtest_b"},
        {"plugtest_b/__init__.py": "", "plugtest_b/server.py": "import nowhere_to_be_found\n"},
    )
    with pytest.raises(
        PluginError,
        match=r"method 'plugtest_b' of plugtest-broken: importing plugtest_b.server failed: "
        r"ModuleNotFoundError.*pip uninstall plugtest-broken",
    ):
        load_methods("server")


def test_an_entry_point_naming_an_object_is_refused(site):
    install(site, "plugtest-obj", {"plugtest_c": "plugtest_c:thing"}, {"plugtest_c/__init__.py": "thing = 1\n"})
    with pytest.raises(PluginError, match="must name a package, not an object"):
        load_methods("client")


def test_two_distributions_declaring_one_name_are_refused(site):
    install(site, "plugtest-one", {"fedavg": "plugtest_d"}, {"plugtest_d/__init__.py": ""})
    with pytest.raises(
        PluginError, match=r"method 'fedavg' is declared by fedge \(methods.fedavg\) and by plugtest-one"
    ):
        method_entry_points()


def test_fedges_own_methods_are_declared():
    names = {ep.name for ep in method_entry_points()}
    assert {"fedavg", "fedprox", "pfedclub", "dcpfl", "fedmn"} <= names


def test_a_registry_loads_once_on_first_read_and_again_after_a_failure():
    calls = []

    def load():
        calls.append(1)
        if len(calls) == 1:
            raise PluginError("broken")
        registry.add("b", 2)

    registry = Registry("thing", KeyError, load)
    registry.add("a", 1)  # adding does not load
    assert calls == []
    with pytest.raises(PluginError):
        list(registry)
    assert list(registry) == ["a", "b"] and registry.get("b") == 2 and len(calls) == 2
    assert "b" in registry and len(registry) == 2 and len(calls) == 2
