"""The run flow around a backend: kernels chosen, lifecycle hooks fired, metrics written, failures kept."""

from __future__ import annotations

import json

import pytest

from primus.core import hookimpl
from primus.core.contracts.engine import BackendSpec
from primus.core.contracts.plugins import DISABLE_ENV, Registry, build_plugin_manager
from primus.core.launch.rank import run_rank
from primus.core.launch.resolve import resolve
from primus.core.run import testing

pytest.importorskip("torch")  # run_rank detects the device through torch


class Seen:
    events: list = []

    @hookimpl
    def primus_on_train_start(self, config, info):
        self.events.append(("start", info.rank, info.flops_per_token > 0))

    @hookimpl
    def primus_on_train_end(self, summary, info):
        self.events.append(("end", summary["status"]))


def test_run_writes_metrics_and_calls_hooks(tmp_path):
    """Core's stand-in engine (loss 10 / step) through core's loop: the kernels chosen, a metrics row a step, the
    summary and the resolved config written, the lifecycle hooks fired once each."""
    seen = Seen()
    seen.events = []
    res = resolve(
        "tiny-llama",
        ["backend.name=stand-in", "train.steps=3", f"logging.output_dir={tmp_path}", "logging.tensorboard=false"],
        world_size=1,
        registry=testing.registry(("seen", seen)),
    )
    summary = run_rank(res)
    assert summary["status"] == "ok" and summary["final_step"] == 3
    assert summary["kernels"] == {
        "attention": "sdpa",
        "rms_norm": "torch",
        "swiglu": "torch",
        "cross_entropy": "torch",
        "rope": "torch",  # and no grouped_gemm: a dense model runs no experts
    }
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[2]["loss"] == pytest.approx(10 / 3)
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "ok"
    assert "hidden_size: 128" in (tmp_path / "config.yaml").read_text()
    assert seen.events == [("start", 0, True), ("end", "ok")]


def test_the_first_step_says_it_is_done_when_it_logs_no_row(tmp_path, caplog):
    """With logging.interval past step 1 the first step's own line says it finished (a GPU run's first step holds the
    build and the first kernels: seconds with nothing said); with interval 1 its metrics row is that line."""
    base = ["backend.name=stand-in", "train.steps=4", "logging.tensorboard=false"]
    for interval, said in ((3, True), (1, False)):
        caplog.clear()
        out = tmp_path / str(interval)
        res = resolve("tiny-llama", [*base, f"logging.interval={interval}", f"logging.output_dir={out}"], world_size=1,
                      registry=testing.registry())  # fmt: skip
        with caplog.at_level("INFO", logger="primus"):
            run_rank(res)
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step 1/4 done")]
        assert bool(lines) is said, lines
        assert not said or "metrics every 3 steps (logging.interval)" in lines[0]


def test_failure_is_recorded_and_reraised(tmp_path):
    seen = Seen()
    seen.events = []
    res = resolve(
        "tiny-llama",
        ["backend.name=stand-in", "backend.extra.fail_at=2", f"logging.output_dir={tmp_path}"]
        + ["logging.tensorboard=false"],
        world_size=1,
        registry=testing.registry(("seen", seen)),
    )
    with pytest.raises(RuntimeError, match="engine failed at step 2"):
        run_rank(res)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == {"status": "failed", "error": "RuntimeError: engine failed at step 2"}
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1  # the step before the failure is kept
    assert seen.events[-1] == ("end", "failed")


def test_user_errors_from_a_backend_are_one_line_exit_2(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from primus.core.cli import app as cli
    from primus.core.contracts import plugins
    from primus.core.data import DataError

    def missing_tokenizer(cfg, ctx):
        raise DataError("data.tokenizer: /nope/tokenizer.json does not exist")

    class B:
        @staticmethod
        @hookimpl
        def primus_backends():
            return [BackendSpec("datafail", "", engine=missing_tokenizer)]

    monkeypatch.setattr(plugins, "_cached", Registry(build_plugin_manager(extra_plugins=[("b", B)])))
    res = CliRunner().invoke(
        cli.app,
        ["train", "tiny-llama", "backend.name=datafail", f"logging.output_dir={tmp_path}", "logging.tensorboard=false"],
    )
    assert res.exit_code == 2 and "error: data.tokenizer: /nope/tokenizer.json does not exist" in res.output
    assert "Traceback" not in res.output


def test_a_backend_without_an_engine_is_refused_at_load_naming_it(monkeypatch):
    """``BackendSpec.engine`` is required: a plugin that registers a backend without one is rejected when the
    registry loads it (``primus plugins`` shows why), and its other backends with it; the rest load."""

    class NoEngine:
        @staticmethod
        @hookimpl
        def primus_backends():
            return [BackendSpec("half", "", engine=None)]

    class Legacy:
        @staticmethod
        @hookimpl
        def primus_backends():
            return [BackendSpec("legacy", "", run=lambda cfg, ctx: {})]  # the removed ``run`` contract

    monkeypatch.setenv(DISABLE_ENV, "1")
    registry = testing.registry(("no-engine", NoEngine), ("legacy", Legacy))
    assert set(registry.backends) == {"stand-in"}
    errors = {name: registry.pm.records[name].error for name in ("no-engine", "legacy")}
    assert "backend 'half': BackendSpec.engine must be an engine builder" in errors["no-engine"]
    assert "unexpected keyword argument 'run'" in errors["legacy"]


def test_an_engine_missing_a_member_of_the_contract_is_refused_naming_it(tmp_path):
    """The engine contract (primus.core.contracts.engine) is checked once, right after the build: an engine without
    ``load`` and with a ``barrier`` that is not callable is refused before any step, naming the backend and both,
    and is closed; the stand-in's optional members are what the check reports it offers."""
    from primus.core.contracts.engine import check_engine
    from primus.core.contracts.errors import UserError

    closed = []

    class Partial(testing.StandInEngine):
        load = None
        barrier = "not a method"

        def close(self) -> None:
            closed.append(True)

    class Backends:
        @staticmethod
        @hookimpl
        def primus_backends():
            return [BackendSpec("partial", "", engine=Partial)]

    registry = Registry(build_plugin_manager(extra_plugins=[("backends", Backends)]))
    overrides = ["backend.name=partial", "train.steps=2", f"logging.output_dir={tmp_path}"]
    testing.StandInEngine.calls = []
    with pytest.raises(UserError, match=r"backend 'partial'.* lacks load, barrier of the engine contract"):
        run_rank(resolve("tiny-llama", overrides, world_size=1, registry=registry))
    assert closed == [True] and testing.StandInEngine.calls == []  # no step ran
    assert not (tmp_path / "metrics.jsonl").exists() or (tmp_path / "metrics.jsonl").read_text() == ""

    class Ctx:
        pass

    cfg = resolve("tiny-llama", ["backend.name=partial"], world_size=1, registry=registry).config
    stand_in = testing.StandInEngine(cfg, Ctx())
    assert check_engine(stand_in, "stand-in") == {"evaluate", "load_native", "save_weights"}
    stand_in.summary, stand_in.save_weights = {"backend": "stand-in"}, None  # an attribute set counts, None does not
    assert check_engine(stand_in, "stand-in") == {"evaluate", "load_native", "summary"}
