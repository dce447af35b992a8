"""Primus sessions. `nox` runs the default set: lint, the tests of each package alone, megatron_compat (primus-megatron
against the megatron-core release of Python >= 3.12), then integration.

    nox                      lint + tests(core), tests(megatron), ... + megatron_compat + integration (what CI runs)
    nox -s demo              train the tiny-demo recipe on CPU (not in the default set: it is the main job,
                             not a test; the backends' own sessions train tiny models already)
    nox -s "tests(turbo)"    one package's tests; `nox -l` lists the sessions
    nox -R -s ...            reuse a session's virtualenv without reinstalling (fast local reruns)

Packages are found by listing packages/*/pyproject.toml (as hydra's noxfile lists its plugins), so a new
package gets its `tests(<name>)` session by existing. Each package session first installs only that package and
primus-core, as a user would, and runs the commands its pyproject lists under `[tool.primus] smoke` (its main job);
then it adds what its tests need (its extras, its `[dependency-groups] test`, else pytest) and runs them.

torch is always `torch==2.13.0`, the CPU build on this machine's disk: every install runs under a constraints
file that pins it (and triton, to the release on disk), so no dependency can pull another build.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import tempfile
import tomllib
from datetime import datetime
from pathlib import Path

import nox
from packaging.requirements import Requirement

nox.needs_version = ">=2025.2.9"  # nox.project.dependency_groups
nox.options.default_venv_backend = "virtualenv"
nox.options.sessions = ["lint", "core_alone", "tests", "megatron_compat", "integration"]
nox.options.error_on_missing_interpreters = True  # no Python 3.11 must fail the run, not skip every session

ROOT = Path(__file__).parent
PYTHON = "3.11"  # the torch wheel on disk is built for CPython 3.11
TORCH = "torch==2.13.0"
# Triton (primus-turbo[triton], run by the Triton interpreter on CPU): the newest release this machine's package
# index holds on disk. Unpinned, pip takes a newer one from PyPI, a 286 MB download in each of four sessions (and a
# failed CI run when the connection drops).
TRITON = "triton==3.8.0"
RUFF = "ruff==0.17.6"
MYPY = "mypy==2.4.1"
# What lint type-checks (settings: mypy.ini): the engine contract and the adapters that declare it, and the way from
# the launcher to core's loop ...
TYPED = ["-p", "primus.core.contracts", "-m", "primus.megatron.engine", "-m", "primus.torchtitan.engine"]
TYPED += ["-m", "primus.core.launch.start", "-m", "primus.core.launch.resolve", "-m", "primus.core.launch.rank"]
TYPED += ["-m", "primus.core.run.rundir"]
# ... and an adapter that breaks it, on which the check must fail, naming each break
WRONG_ADAPTER = ("tests/fixtures/wrong_adapter.py", ['"evaluate" incompatible with supertype', 'attribute "close"'])
LINT_PATHS = ("packages", "tests", "benchmarks", "docs", "noxfile.py")
# The root tests build and install tests/fixtures/primus-example-plugin without build isolation (works offline).
INTEGRATION_DEPS = ["pytest>=8", "hatchling>=1.24"]
# Extras that only do something on a GPU (e.g. primus-tune[cuda] = nvmath-python): not installed on CPU CI.
GPU_ONLY_EXTRAS = {"cuda"}
# In-tree packages a package's tests use besides itself (installed from packages/, with their extras).
TEST_PACKAGES = {"torchtitan": ["turbo"], "megatron": ["turbo"]}
# pytest-xdist workers, one per core of a CI machine (2): the engines' tests are mostly runs in child processes
# (one worker imports an engine or waits on a rendezvous while the other computes); core's and turbo's are
# in-process and single-threaded for the most part (measured: core 48 -> 35 s, turbo 38 -> 31 s). Each test file
# runs whole on one worker (--dist loadfile), so module fixtures are built once. Integration runs its tests the
# same way, but for SERIAL ones, run alone after the rest.
WORKERS = {"core": 2, "turbo": 2, "megatron": 2, "torchtitan": 2, "integration": 2}
# Tests that install and uninstall a distribution in the session's environment: nothing may run beside them.
SERIAL = ["tests/test_example_plugin.py", "tests/test_example_plan.py"]
XDIST = "pytest-xdist>=3.5"
# primus-core's tests that compare with an engine's own code (megatron-core's indexed dataset builder and reader):
# tests(core) has no engine installed, so integration runs them.
CORE_WITH_ENGINES = [
    "packages/primus-core/tests/test_data_indexed.py",
    "packages/primus-core/tests/test_data_prepare.py",
]
# Packages integration installs bare (no extras, no test group): their own session tests them with their libraries.
# The loggers': megatron-core imports wandb whenever it is installed, 10-20 s in every megatron process.
INTEGRATION_BARE = {"loggers"}
# Extras integration leaves out: primus-core[profile] (HolisticTraceAnalysis brings jupyterlab, ~2 min to install).
INTEGRATION_SKIP_EXTRAS = {"profile"}
# primus-megatron takes megatron-core 0.16.1 on Python < 3.12 and 0.19.2 on >= 3.12 (every release from 0.17 requires
# it). megatron_compat installs 0.19.2's cp311 wheel on CI's 3.11 past that Requires-Python, with the one dependency
# 0.19.2 declares that 0.16.1's environment may lack.
MEGATRON_NEXT = ["megatron-core==0.19.2", "packaging>=24.2"]
# What megatron_compat runs against it (the package's whole set takes ~10 minutes here): what differs between the two
# releases. Left out: the other layouts (tp2_pp2 / dp_replicate x dp_shard / tp2_sp x cp2 on 4 ranks, pp2 1F1B),
# FSDP2, FP8 runs, the other MoE layouts (EP 4, TP 2, TP 2 x EP 2, CP 2 x EP 2) and refusals, HF and Megatron-LM
# imports (tests/, integration), crash safety, health, profiling, the console and families' data.
MEGATRON_NEXT_TESTS = [
    "test_compat.py",  # each API the package calls, on the installed release; kernel numerics; MLA (+ MTP) built
    "test_cpu_redirect.py",  # what the CPU redirection assumes of megatron
    "test_validate.py",
    "test_train_layouts.py::test_world_size_1_trains_and_reports",
    # one run per parallel layout kind: DP + distributed optimizer, TP + SP, PP + VPP, CP (against world size 1)
    "test_train_layouts.py::test_layout_matches_world_size_1[dp2_distopt_overlap]",
    "test_train_layouts.py::test_layout_matches_world_size_1[tp2_sp_selective_recompute]",
    "test_train_layouts.py::test_layout_matches_world_size_1[pp2_vpp2_interleaved]",
    "test_train_layouts.py::test_layout_matches_world_size_1[cp2]",
    # checkpoints: save / resume, the manifest, the common state read back (dp 1 -> 2)
    "test_checkpoint_resume.py::test_resume_equals_straight_through",
    "test_checkpoint_resume.py::test_manifest",
    "test_checkpoint_resume.py::test_resume_at_dp2_of_a_dp1_checkpoint",
    "test_checkpoint_resume.py::test_a_checkpoint_of_megatron_core_0_16_resumes_on_the_installed_release",
    # mixture of experts: EP 2 against one rank, and its distributed-optimizer checkpoint resumed
    "test_moe.py::test_expert_parallel_layouts_match_world_size_1[ep2]",
    "test_moe.py::test_resume_under_ep2_equals_straight_through",
    # LoRA: adapters on the fused layout, DP / TP (± SP) curves, resume, the adapters-only checkpoint, export
    "test_lora.py",
]


def list_packages() -> dict[str, Path]:
    """Short name (``core``, ``turbo``, ...) -> package folder, for every packages/<dist>/pyproject.toml."""
    return {p.parent.name.removeprefix("primus-"): p.parent for p in sorted(ROOT.glob("packages/*/pyproject.toml"))}


PACKAGES = list_packages()


def pyproject(name: str) -> dict:
    return tomllib.loads((PACKAGES[name] / "pyproject.toml").read_text())


def needs_torch(name: str) -> bool:
    return any(Requirement(r).name == "torch" for r in pyproject(name)["project"].get("dependencies", []))


WHEELS: dict[str, Path] = {}  # in-tree package -> its wheel, built once per nox process (wheel())


@functools.cache
def wheel_dir() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="primus-wheels-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def wheel(session: nox.Session, name: str) -> str:
    """The package's wheel, built from its folder once per nox process and installed by every session that takes the
    package: pip given the folder builds a wheel in each install, each in an isolated environment of its own with
    hatchling installed afresh (~1-2 s a package; CI's sessions built 33, now 6)."""
    if name not in WHEELS:
        out = wheel_dir() / name
        session.run_install("python", "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out), str(PACKAGES[name]))
        if (built := next(out.glob("*.whl"), None)) is None:  # --no-install on a reused venv: nothing is installed
            return str(PACKAGES[name])
        WHEELS[name] = built
    return str(WHEELS[name])


def requirement(session: nox.Session, name: str, extras: list[str]) -> str:
    path = wheel(session, name)
    return f"{path}[{','.join(sorted(extras))}]" if extras else path


def site_packages(session: nox.Session) -> Path:
    return Path(session.virtualenv.location, "lib", f"python{PYTHON}", "site-packages")


# The two largest wheels, torch (0.7 GB unpacked) and triton (0.9 GB): unpacked by pip once a nox run, into the first
# session that takes them, then hard-linked from there into each later session's virtualenv before its pip install
# (as uv installs from its cache), which finds them installed: their unpacking saved in each later session, and the
# bytecode of their modules, compiled by the first session's processes, comes along. pip never writes into an
# installed file (it removes one before writing over it, and an uninstall moves files away), nor does Python (bytecode
# is written to a new file, then renamed): a linked file is never changed under another session. A distribution's
# scripts (torchrun, ...) are written anew, for the session's interpreter.
SHARED = ("torch", "triton")
UNPACKED: dict[str, Path] = {}  # distribution -> its .dist-info folder in the session that installed it this run


def link_shared(session: nox.Session, requirements: tuple[str, ...]) -> None:
    site = site_packages(session)
    for name, info in UNPACKED.items():
        # a requirement naming torch or triton brings it (torch==..., an extra [torch] / [triton], primus-torchtitan)
        if any(site.glob(f"{name}-*.dist-info")) or not any(name in r.lower() for r in requirements):
            continue
        record = [line.rsplit(",", 2)[0] for line in (info / "RECORD").read_text().splitlines()]
        tops = {Path(r).parts[0] for r in record if not r.startswith("..")} - {info.name}
        try:
            for top in sorted(tops) + [info.name]:  # the .dist-info last: pip takes the dist as installed from it on
                source = info.parent / top
                if source.is_dir():
                    shutil.copytree(source, site / top, copy_function=os.link, dirs_exist_ok=True)
                else:
                    os.link(source, site / top)
        except OSError as exc:  # another file system, say: pip unpacks it (removing what was linked first)
            session.log(f"{name} not linked from {info.parent} ({exc}): pip installs it")
            continue
        for script in (info.parent / r for r in record if r.startswith("../../../bin/")):
            target = Path(session.virtualenv.location, "bin", script.name)
            _, body = script.read_text().split("\n", 1)
            target.write_text(f"#!{Path(session.virtualenv.location, 'bin', 'python')}\n{body}")
            target.chmod(0o755)


def remember_shared(session: nox.Session) -> None:
    for name in SHARED:
        if name not in UNPACKED and (info := next(site_packages(session).glob(f"{name}-*.dist-info"), None)):
            UNPACKED[name] = info


def uninstall_stale(session: nox.Session, requirements: tuple[str, ...]) -> None:
    """pip takes a wheel of the version already installed as installed: an in-tree package a reused virtualenv
    holds from another build (another nox run) is uninstalled first, so that this run's wheel goes in."""
    site = site_packages(session)
    stale = []
    for path in (r.split("[")[0] for r in requirements if r.split("[")[0] in map(str, WHEELS.values())):
        for info in site.glob(f"{Path(path).name.split('-')[0]}-*.dist-info"):
            origin = info / "direct_url.json"
            if not origin.exists() or json.loads(origin.read_text()).get("url") != Path(path).as_uri():
                stale.append(info.name.split("-")[0])
    if stale:
        session.run_install("python", "-m", "pip", "uninstall", "--yes", "--quiet", *stale, silent=True)


def test_deps(name: str) -> list[str]:
    groups = pyproject(name).get("dependency-groups", {})
    return nox.project.dependency_groups(pyproject(name), "test") if "test" in groups else ["pytest>=8"]


def install(session: nox.Session, *requirements: str) -> None:
    """pip install under a constraints file that pins torch and triton, without byte-compiling: pip would compile
    every module of every wheel (torch alone: ~110 s of a ~120 s install, in each session). The session's processes write the
    bytecode of what they import instead, once (PYTHONDONTWRITEBYTECODE, set on these machines, is cleared for the
    session: with it and no compiled files every process would compile each module it imports, every time)."""
    session.env["PYTHONDONTWRITEBYTECODE"] = ""  # empty: Python writes bytecode
    constraints = Path(session.create_tmp()) / "constraints.txt"
    constraints.write_text(f"{TORCH}\n{TRITON}\n")
    uninstall_stale(session, requirements)
    link_shared(session, requirements)
    session.install("--no-compile", "--constraint", str(constraints), *requirements)
    remember_shared(session)


def install_packages(
    session: nox.Session,
    names: list[str],
    *more: str,
    bare: set[str] = frozenset(),
    skip_extras: set[str] = frozenset(),
) -> None:
    """The named packages with all their extras (what a package ships is tested; those in ``bare`` without),
    plus primus-core: with its ``torch`` extra (data, metrics, reference kernels) when any of them needs torch,
    else bare."""
    torch = any(n == "core" or needs_torch(n) for n in names)
    reqs = []
    for name in dict.fromkeys(["core", *names]):
        if name in bare:
            extras = []
        elif name in names:
            extras = [
                e
                for e in pyproject(name)["project"].get("optional-dependencies", {})
                if e not in GPU_ONLY_EXTRAS and e not in skip_extras
            ]
        else:  # primus-core, as a dependency
            extras = ["torch"] if torch else []
        reqs.append(requirement(session, name, extras))
    install(session, *([TORCH] if torch else []), *reqs, *more)


def pytest(session: nox.Session, *args: str, program: str = "pytest", env: dict[str, str] | None = None) -> None:
    # Exit code 5 is "no tests collected": a package whose tests are still to be written is not a failure.
    # --durations: every CI log lists the slowest tests (what to trim when the suite grows past its budget).
    # Beside other xdist workers, one intra-op thread a process: torch's OpenMP threads of two processes on two cores
    # spin against each other (two tiny-deepseek runs side by side: 12.5 s each with torch's default threads, 7.0 s
    # with one, as one run alone takes 7.3 s).
    env = {**(env or {}), **({"OMP_NUM_THREADS": "1"} if "-n" in args else {})}
    session.run(program, "-q", "--durations=12", *args, *session.posargs, success_codes=[0, 5], env=env)


@nox.session(python=PYTHON, reuse_venv=True)
def lint(session: nox.Session) -> None:
    """ruff check + ruff format --check (settings: ruff.toml); mypy over the engine contract and both adapters'
    engines (settings: mypy.ini), and on an adapter that breaks the contract, which must fail."""
    session.install(RUFF, MYPY)
    paths = [p for p in LINT_PATHS if (ROOT / p).exists()]
    session.run("ruff", "check", *paths)
    session.run("ruff", "format", "--check", *paths)
    session.run("mypy", *TYPED)
    wrong, said = WRONG_ADAPTER
    out = session.run("mypy", wrong, success_codes=[1], silent=True) or ""
    if missing := [s for s in said if s not in out]:
        session.error(f"mypy did not find the contract breaks of {wrong}: {missing}\n{out}")


@nox.session(python=PYTHON, reuse_venv=True)
def core_alone(session: nox.Session) -> None:
    """primus-core with no extras and nothing else (no torch): the CLI's config side must work."""
    install(session, wheel(session, "core"))
    session.run("python", "-c", "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)")
    session.run("primus", "--help", silent=True)
    session.run("primus", "presets", "list", silent=True)
    session.run("primus", "presets", "show", "llama3.1-8b", silent=True)
    session.run("primus", "config", "show", "tiny-demo", "train.steps=5", silent=True)
    session.run("primus", "plan", "--preset", "llama3.1-8b", "--device", "H100", "--engine", "torchtitan", silent=True)
    # a bad config is refused (exit 2) naming the key, without torch
    out = session.run(
        "primus", "config", "validate", "tiny-llama", "model.num_kv_heads=3", success_codes=[2], silent=True
    )
    if "model.num_kv_heads" not in (out or ""):
        session.error("config validate did not name the bad key")


def smoke(session: nox.Session, name: str) -> None:
    """The distribution as a user installs it — primus-core and it, no extras, no sibling — running what it offers:
    the commands its pyproject lists under ``[tool.primus] smoke`` (``{tmp}``: a fresh folder)."""
    commands = pyproject(name).get("tool", {}).get("primus", {}).get("smoke", [])
    if not commands:
        return
    siblings = [f"primus-{n}" for n in PACKAGES if n not in ("core", name)]
    session.run("pip", "uninstall", "--yes", "--quiet", *siblings, silent=True)  # what a reused virtualenv holds
    install(session, *([TORCH] if needs_torch(name) else []), wheel(session, "core"), wheel(session, name))
    tmp = Path(session.create_tmp()) / f"smoke-{datetime.now():%H%M%S%f}"
    for command in commands:
        session.run(*(arg.replace("{tmp}", str(tmp)) for arg in command), silent=True)


def browser(session: nox.Session) -> None:
    """The report page's browser test (primus-core tests/test_profile_report_page.py) renders the page with Debian's
    chromium: installed here when missing, where apt-get can (as root), so `nox` passes on a fresh machine as the
    README says; elsewhere the test says how to get one."""
    if shutil.which("chromium") or not shutil.which("apt-get") or os.geteuid() != 0:
        return
    session.log("installing Debian's chromium for the report page's browser test")
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    session.run("apt-get", "update", "-qq", external=True, silent=True, env=env)
    session.run("apt-get", "install", "-y", "-qq", "chromium", external=True, silent=True, env=env)


@nox.session(python=PYTHON, reuse_venv=True)
@nox.parametrize("package", list(PACKAGES), ids=list(PACKAGES))
def tests(session: nox.Session, package: str) -> None:
    """One package alone: first installed as a user would (with primus-core only) running its smoke commands,
    then with what its tests need (its extras, its test group, TEST_PACKAGES) running its tests."""
    smoke(session, package)
    if package == "core":
        browser(session)
    workers = WORKERS.get(package, 1)
    xdist = [XDIST] if workers > 1 else []
    install_packages(session, [package, *TEST_PACKAGES.get(package, [])], *test_deps(package), *xdist)
    parallel = ["-n", str(workers), "--dist", "loadfile"] if workers > 1 else []
    pytest(session, *parallel, str(PACKAGES[package] / "tests"))


@nox.session(venv_backend="none", requires=["tests(megatron)"])
def megatron_compat(session: nox.Session) -> None:
    """Compatibility check: primus-megatron against megatron-core 0.19.2, the release `pip install primus-megatron`
    takes on Python >= 3.12 (the real target: the GPU images run 3.12), on CI's Python 3.11 with 0.19.2's cp311 wheel
    installed past its Requires-Python (>= 3.12). The package as tests(megatron) installs it (which takes 0.16.1 here):
    that session's own virtualenv (it runs first: requires=; `--no-dependencies` skips it when it has run), with 0.19.2
    over it for the check and 0.16.1 put back after, so the venv is installed once, not twice; pip says
    primus-megatron asks for 0.16.1 on this Python, which is so. Runs MEGATRON_NEXT_TESTS, a subset of the package's
    tests (what differs between the releases)."""
    venv = session.cache_dir.parent / "tests-megatron"  # nox's folder of tests(megatron): envdir / session name
    scripts = venv / "bin"
    python = scripts / "python"
    if not python.exists():
        session.error(f"{venv} is missing: run tests(megatron) first (nox -s megatron_compat runs it)")
    env = {
        "PYTHONDONTWRITEBYTECODE": "",
        "VIRTUAL_ENV": str(venv),
        "PATH": f"{scripts}{os.pathsep}{os.environ['PATH']}",
    }
    constraints = Path(session.create_tmp()) / "constraints.txt"
    constraints.write_text(f"{TORCH}\n{TRITON}\n")
    pip = [str(python), "-m", "pip", "install", "--no-compile", "--constraint", str(constraints), "--no-deps"]
    session.run(*pip, "--ignore-requires-python", *MEGATRON_NEXT, env=env)
    try:
        check = "import primus.megatron.compat as c; assert c.MCORE_0_19, c.INSTALLED"
        session.run(str(python), "-c", check, silent=True, env=env)
        tests = PACKAGES["megatron"] / "tests"
        workers = ["-n", str(WORKERS["megatron"]), "--dist", "loadfile"]
        pytest(
            session, *workers, *(str(tests / t) for t in MEGATRON_NEXT_TESTS), program=str(scripts / "pytest"), env=env
        )
    finally:  # tests(megatron)'s venv as it installed it: primus-megatron's pin for this Python (0.16.1)
        pins = [Requirement(r) for r in pyproject("megatron")["project"]["dependencies"]]
        here = {"python_version": PYTHON}
        current = [f"{r.name}{r.specifier}" for r in pins if r.name == "megatron-core" and r.marker.evaluate(here)]
        session.run(*pip, *current, env=env)


@nox.session(python=PYTHON, reuse_venv=True)
def integration(session: nox.Session) -> None:
    """Every package installed together (core without its profile extra, whose tests are tests(core)'s): the
    cross-package tests (tests/)."""
    deps = INTEGRATION_DEPS + [d for name in PACKAGES if name not in INTEGRATION_BARE for d in test_deps(name)]
    install_packages(
        session, list(PACKAGES), *dict.fromkeys(deps), XDIST, bare=INTEGRATION_BARE, skip_extras=INTEGRATION_SKIP_EXTRAS
    )
    workers = ["-n", str(WORKERS["integration"]), "--dist", "loadfile"]
    pytest(session, *workers, "tests", *(f"--ignore={path}" for path in SERIAL))
    pytest(session, *SERIAL)
    pytest(session, *CORE_WITH_ENGINES)  # core's tests that need megatron-core (skipped in tests(core))


@nox.session(python=PYTHON, reuse_venv=True)
def demo(session: nox.Session) -> None:
    """Train the tiny-demo recipe on CPU with every package installed. Extra args are overrides:
    `nox -s demo -- train.steps=10`."""
    install_packages(session, list(PACKAGES))
    session.run("primus", "env")
    # A new folder per run: a run refuses to start over the checkpoints of an earlier one (unless --resume).
    out = Path("outputs", "tiny-demo", datetime.now().strftime("%Y%m%d-%H%M%S"))
    session.run("primus", "train", "tiny-demo", f"logging.output_dir={out}", *session.posargs)
    session.log(f"metrics: {out}/metrics.jsonl; TensorBoard: tensorboard --logdir {out}/tensorboard")
