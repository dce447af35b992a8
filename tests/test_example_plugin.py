"""A third-party plugin, built and installed like any distribution, shows up everywhere and can be used."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import primus

FIXTURE = Path(__file__).parent / "fixtures" / "primus-example-plugin"
DIST = "primus-example-plugin"


def pip(*args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args], check=True, capture_output=True, text=True
    )


@pytest.fixture(scope="module")
def example_plugin(tmp_path_factory):
    """Build and install the fixture into this environment; uninstall it afterwards.

    No build isolation and no dependencies: hatchling and primus-core are already installed here, so this
    works offline."""
    src = tmp_path_factory.mktemp("src") / "primus-example-plugin"
    shutil.copytree(FIXTURE, src)
    pip("install", "--no-deps", "--no-build-isolation", str(src))
    try:
        yield
    finally:
        pip("uninstall", "--yes", DIST)


def test_backend_kernel_and_presets_are_listed(example_plugin):
    rows = {ln.split()[0]: ln for ln in primus("plugins").stdout.splitlines() if ln.strip()}
    row = rows["example"]
    assert DIST in row and " ok " in row
    assert "backends: example" in row and "kernels: attention:example" in row and "presets:" in row

    listed = primus("presets", "list").stdout
    assert any(ln.split()[:1] == ["example-tiny"] and DIST in ln for ln in listed.splitlines())


def test_its_backend_and_kernel_can_be_selected(example_plugin):
    out = primus("config", "validate", "example-tiny", "backend.name=example", "kernels.attention=example").stdout
    assert "ok: tiny-llama on backend example" in out

    refused = primus("config", "validate", "example-tiny", "--world-size", "2", check=False)
    assert refused.returncode == 2
    assert "the example backend runs in one process" in refused.stderr + refused.stdout


def test_it_trains_through_primus(example_plugin, tmp_path):
    run = primus("train", "example-tiny", f"logging.output_dir={tmp_path}")
    assert "attention=example" in run.stderr
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 20
    assert losses[-1] < 0.5 * losses[0]
