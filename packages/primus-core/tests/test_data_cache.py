"""primus.core.data.cache: a build shared by processes, made once (the others wait on the lock and reuse it); one
that died part way is redone."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from primus.core.data.cache import build_once

BUILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from primus.core.data.cache import build_once

    def build(folder):
        folder.mkdir(parents=True)
        time.sleep(0.5)  # the other process asks meanwhile
        with open(folder.parent / "builds.log", "a") as log:  # outside the folder: a rebuild would not erase it
            log.write(sys.argv[2])

    print(build_once(Path(sys.argv[1]), build))
    """
)


def test_two_processes_build_once(tmp_path):
    folder = tmp_path / "shared"
    procs = [subprocess.Popen([sys.executable, "-c", BUILD, str(folder), str(i)]) for i in range(2)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    assert (tmp_path / "builds.log").read_text() in ("0", "1") and (folder / ".built").is_file()
    built = []
    build_once(folder, built.append)  # finished: not built again
    assert built == []


def test_a_build_that_died_is_redone(tmp_path):
    folder = tmp_path / "half"
    folder.mkdir()
    (folder / "stale").write_text("x")  # no .built mark: a build that died part way
    build_once(folder, lambda f: (f.mkdir(), (f / "new").write_text("y")))
    assert sorted(p.name for p in folder.iterdir()) == [".built", "new"]
