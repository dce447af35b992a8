"""Every in-tree package, installed as a distribution, is found through its ``primus`` entry point."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, distribution

import pytest
from support import in_tree_packages, primus

PACKAGES = in_tree_packages()


@pytest.mark.parametrize("project", PACKAGES, ids=[p["name"] for p in PACKAGES])
def test_installed_with_its_entry_points(project):
    try:
        dist = distribution(project["name"])
    except PackageNotFoundError:
        pytest.fail(f"{project['name']} is not installed in this environment")
    assert dist.version == project["version"]
    declared = project.get("entry-points", {}).get("primus", {})
    assert declared, f"{project['name']} declares no [project.entry-points.primus]"
    installed = {ep.name: ep.value for ep in dist.entry_points if ep.group == "primus"}
    assert installed == declared


def test_primus_plugins_loads_every_package():
    out = primus("plugins").stdout
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    for project in PACKAGES:
        for name in project["entry-points"]["primus"]:
            assert name in rows, f"entry point {name} of {project['name']} missing from `primus plugins`:\n{out}"
            assert project["name"] in rows[name] and " ok " in rows[name], rows[name]


def test_plugin_config_changes_are_attributed_with_every_package_installed(tmp_path):
    exp = tmp_path / "exp.yaml"
    exp.write_text("extends: [tiny-demo]\nkernels: {gemm_tuning: offline}\n")
    out = primus("config", "show", str(exp)).stdout
    row = next(line for line in out.splitlines() if line.startswith("kernels.gemm_tuning_file"))
    assert "plugin primus-tune" in row


def test_tuned_recipe_passes_the_real_backends_checks():
    out = primus("config", "validate", "llama3.2-1b-torchtitan-fsdp-h200-1x1", "--world-size", "8").stdout
    assert "ok: llama3.2-1b on backend torchtitan, world size 8" in out
