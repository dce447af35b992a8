"""The repository names no file outside itself: its code, docs and scripts point into the tree (the GPU install is
benchmarks/gpu/, the H200 baseline the planner is calibrated on is benchmarks/results/h200_baseline.md), never at a
machine's folders beside it. Recorded results (benchmarks/results/) keep the commands as they ran."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = re.compile(r"\.\./shared/|/work/|shared/notes/|shared/gpu/|shared/tools/")
SUFFIXES = {".py", ".md", ".sh", ".toml", ".yaml", ".yml", ".cfg", ".txt"}


def test_no_tracked_file_names_a_path_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    found = []
    for name in tracked.splitlines():
        path = ROOT / name
        if path.suffix not in SUFFIXES or name.startswith("benchmarks/results/") or not path.is_file():
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line) and path.name != Path(__file__).name:
                found.append(f"{name}:{i}: {line.strip()[:120]}")
    assert not found, "paths outside the repository:\n" + "\n".join(found)
