"""The docs under docs/: the generated reference cannot drift from the code (every kernel op, hook and config key
appears in it), and the plugin author's guide's Python blocks run (the example plugin's logger among them)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS))
import generate  # noqa: E402


def test_generated_pages_are_the_code():
    proc = subprocess.run([sys.executable, str(DOCS / "generate.py"), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_op_hook_and_key_is_in_the_reference():
    from primus.core.contracts import hookspecs
    from primus.core.contracts.protocols import KERNEL_OPS
    from primus.core.kernels.contracts import CONTRACTS

    api = (DOCS / "reference" / "plugin-api.md").read_text()
    assert set(CONTRACTS) == set(KERNEL_OPS)
    for op in KERNEL_OPS:
        assert f"| `{op}` |" in api, op
    specs = [n for n in vars(hookspecs) if n.startswith("primus_")]
    assert len(specs) >= 12
    for name in specs:
        assert f"### `{name}(" in api, name
    config = (DOCS / "reference" / "config.md").read_text()
    keys = [row[0] for row in generate.config_rows()]
    assert {"train.optimizer.lr", "parallel.tp", "logging.loggers", "model.moe.num_experts"} <= set(keys)
    for key in keys:
        assert f"| `{key}` |" in config, key


def test_drift_is_caught(tmp_path, monkeypatch):
    page = DOCS / "reference" / "config.md"
    monkeypatch.setattr(generate, "DOCS", tmp_path)
    (tmp_path / "reference").mkdir()
    (tmp_path / "reference" / "config.md").write_text(page.read_text().replace("| `parallel.tp` |", "| `tp` |"))
    stale = [p for p, text in generate.expected().items() if not p.exists() or p.read_text() != text]
    assert tmp_path / "reference" / "config.md" in stale


def _blocks() -> list[str]:
    text = (DOCS / "plugins.md").read_text()
    return [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if not b.startswith("# tests/fixtures")]


@pytest.mark.parametrize("index", range(len(_blocks())))
def test_guide_code_runs(index, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PRIMUS_DISABLE_PLUGIN_AUTOLOAD", "1")
    exec(compile(_blocks()[index], f"docs/plugins.md block {index}", "exec"), {"__name__": "docs_block"})
