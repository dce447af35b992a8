"""The plugin host: discovery, contract checks naming the distribution, duplicate-name rule."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from primus.core import hookimpl, plugins
from primus.core.plugins import Registry, build_plugin_manager
from primus.core.protocols import BackendSpec, KernelProvider


def _ep(name, dist, obj=None, exc=None):
    def load():
        if exc:
            raise exc
        return obj

    meta = SimpleNamespace(metadata={"Name": dist}, version="9.9")
    return SimpleNamespace(name=name, value=f"{dist}.plugin", dist=meta, load=load)


@pytest.fixture
def fake_entry_points(monkeypatch):
    eps: list = []
    monkeypatch.setattr(plugins, "entry_points", lambda group: list(eps) if group == "primus" else [])
    monkeypatch.delenv(plugins.DISABLE_ENV, raising=False)
    return eps


def _backend(name, priority=0):
    class P:
        @staticmethod
        @hookimpl
        def primus_backends():
            return [BackendSpec(name=name, description="", run=lambda c, x: {}, priority=priority)]

    return P


def test_core_is_registered_and_specs_are_complete():
    pm = build_plugin_manager()
    pm.check_pending()  # every implementation has a spec
    assert pm.records["core"].status == "ok"
    reg = Registry(pm)
    assert {"ddp", "fsdp2", "tp_pp_vpp"} <= set(reg.strategies)
    assert reg.providers("attention")[-1].name == "sdpa"


def test_import_failure_is_reported_not_raised(fake_entry_points):
    fake_entry_points.append(_ep("broken", "primus-broken", exc=ImportError("No module named 'nonexistent_dep'")))
    pm = build_plugin_manager()
    rec = pm.records["broken"]
    assert rec.status == "import-failed" and rec.dist == "primus-broken" and "nonexistent_dep" in rec.error
    assert Registry(pm).providers("attention")  # the rest still works


def test_hookspec_violation_rejected_with_distribution(fake_entry_points):
    class BadArgs:
        @staticmethod
        @hookimpl
        def primus_on_step_end(step, metrics, info, not_in_spec):
            pass

    fake_entry_points.append(_ep("badargs", "primus-badargs", BadArgs))
    pm = build_plugin_manager()
    rec = pm.records["badargs"]
    assert rec.status == "rejected" and rec.error.startswith("primus-badargs:") and "not_in_spec" in rec.error
    assert pm.get_plugin("badargs") is None


def test_unknown_hook_rejected(fake_entry_points):
    class Typo:
        @staticmethod
        @hookimpl
        def primus_backend():  # missing 's'
            return []

    fake_entry_points.append(_ep("typo", "primus-typo", Typo))
    rec = build_plugin_manager().records["typo"]
    assert rec.status == "rejected" and "primus-typo" in rec.error and "primus_backend" in rec.error


def test_wrong_return_type_rejected_naming_distribution(fake_entry_points):
    class Wrong:
        @staticmethod
        @hookimpl
        def primus_backends():
            return [{"name": "dicty"}]

    fake_entry_points.append(_ep("wrong", "primus-wrong", Wrong))
    reg = Registry(build_plugin_manager())
    assert "dicty" not in reg.backends
    rec = reg.pm.records["wrong"]
    assert (
        rec.status == "rejected"
        and "primus-wrong: primus_backends" in rec.error
        and "expected BackendSpec" in rec.error
    )


def test_duplicate_backend_rule_is_deterministic_and_logged(fake_entry_points, caplog):
    fake_entry_points.extend(
        [_ep("zeta", "primus-zeta", _backend("same")), _ep("alpha", "primus-alpha", _backend("same"))]
    )
    with caplog.at_level(logging.INFO, logger="primus.plugins"):
        reg = Registry(build_plugin_manager())
        assert reg.backends["same"].dist == "primus-alpha"  # equal priority: distribution name decides
    assert any("same from primus-zeta is shadowed by primus-alpha" in m for m in caplog.messages)


def test_higher_priority_wins_duplicates(fake_entry_points):
    fake_entry_points.extend(
        [_ep("alpha", "primus-alpha", _backend("same")), _ep("zeta", "primus-zeta", _backend("same", priority=5))]
    )
    assert Registry(build_plugin_manager()).backends["same"].dist == "primus-zeta"


def test_plugin_kernel_shadows_core_of_same_name(fake_entry_points):
    class Sdpa:
        @staticmethod
        @hookimpl
        def primus_kernels():
            return [KernelProvider(op="attention", name="sdpa", impl="x:y", available=lambda d, **k: True)]

    fake_entry_points.append(_ep("mine", "primus-mine", Sdpa))
    reg = Registry(build_plugin_manager())
    assert reg.kernels[("attention", "sdpa")].dist == "primus-mine"
    assert any("shadowed by primus-mine" in s for s in reg.shadowed)


def test_autoload_can_be_disabled(fake_entry_points, monkeypatch):
    fake_entry_points.append(_ep("other", "primus-other", _backend("other")))
    monkeypatch.setenv(plugins.DISABLE_ENV, "1")
    pm = build_plugin_manager()
    assert set(pm.records) == {"core"}


def test_missing_backend_message_names_failed_distribution(fake_entry_points):
    fake_entry_points.append(_ep("megatron", "primus-megatron", exc=ImportError("No module named 'megatron'")))
    msg = Registry(build_plugin_manager()).missing_backend_message("megatron")
    assert "primus-megatron" in msg and "did not load" in msg and "No module named 'megatron'" in msg


def test_plugin_command_group_is_mounted(fake_entry_points, monkeypatch):
    import typer
    from typer.testing import CliRunner

    from primus.core import cli

    group = typer.Typer()

    @group.command()
    def hello(name: str = "x"):
        print(f"hello {name}")

    class Cmds:
        @staticmethod
        @hookimpl
        def primus_commands():
            return [("greet", group), ("config", typer.Typer())]  # "config" is core's: refused

    fake_entry_points.append(_ep("cmds", "primus-cmds", Cmds))
    monkeypatch.setattr(plugins, "_cached", None)
    monkeypatch.setattr(cli, "app", typer.Typer())
    cli.app.add_typer(typer.Typer(), name="config")
    cli.add_plugin_commands()
    res = CliRunner().invoke(cli.app, ["greet", "hello", "--name", "primus"])
    assert res.exit_code == 0 and "hello primus" in res.output
    assert [g.name for g in cli.app.registered_groups].count("config") == 1
