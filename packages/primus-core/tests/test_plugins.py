"""The plugin host: discovery, contract checks naming the distribution, duplicate-name rule."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pluggy
import pytest

from primus.core import hookimpl
from primus.core.contracts import plugins
from primus.core.contracts.engine import BackendSpec, RunContext
from primus.core.contracts.plugins import PrimusPluginManager, Registry, build_plugin_manager
from primus.core.contracts.protocols import KernelProvider
from primus.core.launch.resolve import configure_changes


def _ep(name, dist, obj=None, exc=None):
    def load():
        if exc:
            raise exc
        return obj

    meta = SimpleNamespace(metadata={"Name": dist}, version="9.9")
    return SimpleNamespace(name=name, value=f"{dist}.plugin", dist=meta, load=load)


@pytest.fixture
def fake_entry_points(monkeypatch):
    # core's own plugin is found by its entry point, as installed (the host imports no room above it)
    eps: list = [ep for ep in plugins.entry_points(group="primus") if ep.name == "core"]
    monkeypatch.setattr(plugins, "entry_points", lambda group: list(eps) if group == "primus" else [])
    monkeypatch.delenv(plugins.DISABLE_ENV, raising=False)
    return eps


def _backend(name, priority=0):
    class P:
        @staticmethod
        @hookimpl
        def primus_backends():
            return [
                BackendSpec(
                    name=name, description="", engine="primus.core.run.testing:StandInEngine", priority=priority
                )
            ]

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
        def primus_on_log(step, metrics, info, not_in_spec):
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

    from primus.core.cli import app as cli

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
    app = typer.Typer()
    app.add_typer(typer.Typer(), name="config")
    cli.add_plugin_commands(app)
    res = CliRunner().invoke(app, ["greet", "hello", "--name", "primus"])
    assert res.exit_code == 0 and "hello primus" in res.output
    assert [g.name for g in app.registered_groups].count("config") == 1


# ------------------------------------------------------------------ every hook goes through pluggy


def test_check_pending_reports_an_implementation_without_spec():
    class Typo:
        @staticmethod
        @hookimpl
        def primus_on_trian_end(summary, info):  # misspelt: no spec
            pass

    pm = build_plugin_manager()
    pm.register(Typo, name="typo")  # plain pluggy registration: register_checked would reject it
    with pytest.raises(pluggy.PluginValidationError, match="primus_on_trian_end"):
        pm.check_pending()


def test_configure_implementation_may_take_fewer_arguments_than_its_spec(fake_entry_points):
    class Fewer:
        @staticmethod
        @hookimpl
        def primus_configure():  # the spec passes ``config``; pluggy hands over only what is asked for
            return {"train.steps": 7}

    fake_entry_points.append(_ep("fewer", "primus-fewer", Fewer))
    changes = configure_changes(Registry(build_plugin_manager()))({"train": {"steps": 1}})
    assert ("plugin primus-fewer", {"train": {"steps": 7}}) in changes


def test_tryfirst_and_trylast_order_contributions(fake_entry_points):
    def offering(name, **order):
        class P:
            @staticmethod
            @hookimpl(**order)
            def primus_commands():
                return [(name, object())]

        return P

    # registered alpha then zeta: pluggy alone would call zeta first; the markers reverse that
    fake_entry_points.extend(
        [
            _ep("alpha", "primus-alpha", offering("a", tryfirst=True)),
            _ep("zeta", "primus-zeta", offering("z", trylast=True)),
        ]
    )
    assert [name for name, _ in Registry(build_plugin_manager()).commands] == ["a", "z"]


def test_hookwrapper_sees_and_changes_each_plugins_result(fake_entry_points):
    seen: list[str] = []

    class Filter:
        @staticmethod
        @hookimpl(hookwrapper=True)
        def primus_backends():
            outcome = yield
            specs = [b for result in outcome.get_result() for b in result]
            seen.extend(b.name for b in specs)
            outcome.force_result([[b for b in specs if b.name != "hidden"]])

    fake_entry_points.extend(
        [
            _ep("filter", "primus-filter", Filter),
            _ep("shown", "primus-shown", _backend("shown")),
            _ep("hidden", "primus-hidden", _backend("hidden")),
        ]
    )
    reg = Registry(build_plugin_manager())
    assert "shown" in reg.backends and "hidden" not in reg.backends
    assert sorted(seen) == ["hidden", "shown"]  # called once per implementation, each result seen
    assert reg.backends["shown"].dist == "primus-shown"  # still put down to the plugin that offered it
    assert reg.pm.records["filter"].status == "ok" and "backends" not in reg.pm.records["filter"].provides


def test_failing_implementation_is_set_aside_the_others_still_count(fake_entry_points):
    class Boom:
        @staticmethod
        @hookimpl(tryfirst=True)
        def primus_backends():
            raise RuntimeError("boom")

    fake_entry_points.extend([_ep("boom", "primus-boom", Boom), _ep("fine", "primus-fine", _backend("fine"))])
    reg = Registry(build_plugin_manager())
    assert "fine" in reg.backends
    rec = reg.pm.records["boom"]
    assert rec.status == "rejected" and rec.error == "primus-boom: primus_backends failed: boom"


# ------------------------------------------------------------------ lifecycle hooks: new names, deprecated old ones


def _run_context(*plugins_):
    pm = PrimusPluginManager()  # no core: its run logger would write files
    for i, p in enumerate(plugins_):
        pm.register_checked(p, f"p{i}", f"primus-p{i}", "", "")
    return pm, RunContext(info=SimpleNamespace(rank=0), hooks=pm.hook)


def test_run_context_calls_the_lifecycle_hooks_and_an_old_hook_name_is_refused(caplog):
    calls: list[tuple] = []

    class New:
        @staticmethod
        @hookimpl
        def primus_on_optimizer_step(step):
            calls.append(("optimizer_step", step))

        @staticmethod
        @hookimpl
        def primus_on_log(step, metrics):
            calls.append(("log", step, metrics["loss"]))

    class Old:  # the names before primus_on_optimizer_step / primus_on_log (removed)
        @staticmethod
        @hookimpl
        def primus_on_train_step(step, info):
            calls.append(("train_step", step))

    with caplog.at_level(logging.ERROR, logger="primus.plugins"):
        pm, ctx = _run_context(New, Old)
    assert pm.records["p0"].status == "ok"
    assert pm.records["p1"].status == "rejected"
    assert pm.records["p1"].error == "primus-p1: implements hooks that Primus does not define: primus_on_train_step"
    ctx.train_step(1)
    ctx.step_end(1, {"loss": 2.0})
    assert calls == [("optimizer_step", 1), ("log", 1, 2.0)]


def test_core_and_tune_implement_only_current_hook_names(recwarn):
    pm = build_plugin_manager()
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning) and "primus_on" in str(w.message)]
    assert not hasattr(pm.hook, "primus_on_train_step") and not hasattr(pm.hook, "primus_on_step_end")
    assert "core" in {i.plugin_name for i in pm.hook.primus_on_log.get_hookimpls()}
