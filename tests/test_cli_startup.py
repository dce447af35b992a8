"""The CLI starts without torch or an engine (fast `primus --help`; the config tools work without a GPU stack)."""

from __future__ import annotations

import ast
import subprocess
import sys

HEAVY = ("torch", "megatron", "torchtitan")


def loaded_after(code: str) -> list[str]:
    probe = f"import sys\n{code}\nprint(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return ast.literal_eval(proc.stdout.strip().splitlines()[-1])


def test_help_imports_no_torch():
    assert (
        loaded_after(
            "sys.argv = ['primus', '--help']\nfrom primus.core.cli import app as cli\n"
            "try:\n    cli.main()\nexcept SystemExit:\n    pass"
        )
        == []
    )


def test_listing_plugins_and_validating_a_config_import_no_engine():
    code = (
        "from primus.core.cli import app as cli\nfor argv in (['plugins'], ['config', 'validate', 'tiny-demo']):\n"
        "    sys.argv = ['primus', *argv]\n    try:\n        cli.main()\n    except SystemExit as e:\n"
        "        assert not e.code, e.code"
    )
    assert not set(loaded_after(code)) & {"megatron", "torchtitan"}


def test_a_command_imports_only_its_own_module():
    """``primus train`` imports train's module, not plan's (nor the planner's search) or the other commands'."""
    probe = (
        "import sys\nfrom primus.core.cli import app as cli\nsys.argv = ['primus', 'train', '--help']\n"
        "try:\n    cli.main()\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith(('primus.core.cli.', 'primus.core.planner'))))"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ast.literal_eval(proc.stdout.strip().splitlines()[-1]) == [
        "primus.core.cli.app",
        "primus.core.cli.helpers",
        "primus.core.cli.train",
    ]
