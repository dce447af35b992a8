"""A third-party backend is planned by ``primus plan`` with the facts its own profile gives, with no edit to core:
the example plugin (tests/fixtures/primus-example-plugin) names ``primus_example.planner_profile:PROFILE`` in its
``BackendSpec(planner=...)``: one process, fp32 weights under AdamW, no recompute."""

from __future__ import annotations

import pytest
from support import primus
from test_example_plugin import example_plugin  # noqa: F401 - the fixture that builds and installs the plugin

pytestmark = pytest.mark.usefixtures("example_plugin")

HEADER = ("weights", "gradients", "optimizer")


def _rows(stdout: str) -> list[dict[str, str]]:
    """The plan table's rows as {column: cell} for its numeric columns (read from the right: the layout cell holds
    spaces)."""
    lines = stdout.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["#", "layout"])
    names = lines[head].replace("total GiB", "total").replace("step s", "step").split()[2:]
    rows = []
    for ln in lines[head + 1 :]:
        cells = ln.split()
        if not cells or not cells[0].isdigit():
            break
        rows.append(dict(zip(names, cells[len(cells) - len(names) :], strict=True)))
    return rows


@pytest.fixture(autouse=True)
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # rich lays the table out for this width: one line per layout


def test_its_recipe_is_planned_with_its_profile():
    run = primus("plan", "--preset", "example-tiny", "--gpus", "1", "--device", "H100")
    assert "note:" not in run.stderr  # the backend's own profile, not the generic engine
    assert "example, seq 32" in " ".join(run.stdout.split())
    assert len(_rows(run.stdout)) == 1  # one process, no recompute: one layout
    assert run.stdout.rstrip().endswith("recommended: DDP 1, no recompute")


def test_the_numbers_are_its_facts():
    """llama3.2-1b as the example engine: fp32 weights and gradients (4 bytes each), Adam's m and v and no master
    copy (8); the generic engine would count bf16 weights and a master copy (2, 4, 12)."""
    run = primus("plan", "--preset", "llama3.2-1b", "--engine", "example", "--gpus", "1", "--device", "H200")
    [row] = _rows(run.stdout)
    weights, grads, optimizer = (float(row[k]) for k in HEADER)
    assert weights == pytest.approx(grads, abs=0.1) and optimizer == pytest.approx(2 * weights, abs=0.1)
    generic = primus("plan", "--preset", "llama3.2-1b", "--engine", "generic", "--gpus", "1", "--device", "H200")
    plain = _rows(generic.stdout)[0]
    unknown = primus("plan", "--preset", "llama3.2-1b", "--engine", "no-such-engine", check=False)
    assert unknown.returncode == 2 and "no-such-engine" in unknown.stderr and "example" in unknown.stderr
    assert float(plain["weights"]) == pytest.approx(weights / 2, abs=0.1)


def test_what_it_cannot_run_is_not_planned():
    run = primus("plan", "--preset", "example-tiny", "--gpus", "2", "--device", "H100", check=False)
    assert run.returncode == 4, run.stderr  # the documented exit: the engine refuses every layout
    assert "example refuses every layout on 1×2 GPUs" in " ".join(run.stderr.split())
