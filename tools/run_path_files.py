"""Which primus source files one ``primus train`` enters before the first optimizer step, and how many imports of
``primus.*`` sit inside functions.

    python tools/run_path_files.py [PRESET] [-v]

Counted with ``sys.setprofile`` in this process (one rank, CPU): every Python function call whose code lives in a
``packages/*/src/primus`` file marks that file entered, from ``primus train PRESET train.steps=10`` until the first
call of a ``step`` method defined in ``torch/optim/``; then the run stops. Module bodies executed at import count
too (their code objects are entered like calls). Function-level imports are counted on the sources with ``ast``:
``import``/``from`` statements of ``primus`` modules nested in a function.

The path of the config: the calls of core functions that take it (an argument that is the ``PrimusConfig``, the
resolved run holding it, or the ``config`` string of the command line), in call order, from the CLI until the first
call into a backend's package; its modules, and how often the next of those calls is in a room above the previous
one's (core's rooms, top to bottom, as ``tests/test_core_rooms.py`` lists them)."""

from __future__ import annotations

import ast
import sys
import tempfile
from pathlib import Path

PACKAGES = Path(
    sys.argv[2]
    if len(sys.argv) > 2 and not sys.argv[2].startswith("-")
    else Path(__file__).resolve().parents[1] / "packages"
)


ROOMS = ["builtin", "cli", "launch", "run", "planner", "hf", "kernels", "data", "profile", "config", "contracts"]


class FirstStep(BaseException):
    pass


def _takes_config(frame) -> bool:
    code = frame.f_code
    for name in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]:
        value = frame.f_locals.get(name)
        if name == "config" and isinstance(value, str):
            return True
        for v in (value, getattr(value, "config", None)):
            if type(v).__name__ == "PrimusConfig":
                return True
    return False


def _room(path: str) -> str:
    part = path.split("/src/primus/core/", 1)[1]
    return part.split("/", 1)[0] if "/" in part else part.removesuffix(".py")


CONFIG_PATH: list[str] = []  # the core modules of the config's calls, in order, until the run room calls the engine


def files_to_first_step(preset: str) -> list[str]:
    entered: dict[str, int] = {}
    engine = False

    def profile(frame, event, arg):
        nonlocal engine
        if event != "call":
            return
        f = frame.f_code.co_filename
        if "/torch/optim/" in f and frame.f_code.co_name == "step":
            raise FirstStep
        if "/src/primus/" in f and f not in entered:
            entered[f] = len(entered)
        if "/src/primus/" in f and not engine and frame.f_code.co_name != "<module>":
            if "/src/primus/core/" not in f:  # a plugin's hook, or the engine: core's run room hands it the config
                engine = "/src/primus/core/run/" in frame.f_back.f_code.co_filename and _takes_config(frame)
            elif _takes_config(frame):
                CONFIG_PATH.append(f)

    with tempfile.TemporaryDirectory() as out:
        sys.argv = ["primus", "train", preset, "train.steps=10", f"logging.output_dir={out}"]
        sys.setprofile(profile)
        try:
            from primus.core import cli  # imported under the profile: module bodies count

            if not hasattr(cli, "main"):  # since core's rooms: primus.core.cli is a package, main is in cli.app
                from primus.core.cli import app as cli

            cli.main()
        except (FirstStep, SystemExit):
            pass
        finally:
            sys.setprofile(None)
    return [f.split("/src/", 1)[1] for f in sorted(entered, key=entered.get)]


def function_level_imports() -> int:
    seen: set[int] = set()
    trees = [ast.parse(p.read_text()) for p in PACKAGES.glob("*/src/**/*.py")]  # kept alive: ids stay unique
    for tree in trees:
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                for node in ast.walk(fn):
                    mod = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                    if isinstance(node, ast.ImportFrom):
                        mod = [("." if node.level else "") + (node.module or "")]
                    if any(m.startswith(("primus", ".")) for m in mod):
                        seen.add(id(node))
    return len(seen)


def config_path() -> tuple[int, int]:
    """(modules the config's path enters, times its next call is in a room above the previous one's)."""
    rank = {r: i for i, r in enumerate(ROOMS)}
    rooms = [rank.get(_room(f), len(ROOMS)) for f in CONFIG_PATH]  # the package root: below every room
    return len(set(CONFIG_PATH)), sum(b < a for a, b in zip(rooms, rooms[1:], strict=False))


if __name__ == "__main__":
    args, verbose = [a for a in sys.argv[1:] if not a.startswith("-")], "-v" in sys.argv
    files = files_to_first_step(args[0] if args else "tiny-demo")
    if verbose:
        print("\n".join(files))
    core = [f for f in files if f.startswith("primus/core/")]
    print(f"files entered before the first optimizer step: {len(files)} ({len(core)} in primus-core)")
    print(f"function-level imports of primus modules: {function_level_imports()}")
    modules, up = config_path()
    if verbose:
        print("\n".join(f.split("/src/", 1)[1] for f in CONFIG_PATH))
    print(f"the config from the CLI to the engine: {modules} modules, back up a room {up} times")
