"""``primus`` leaves without the interpreter's teardown (primus.core.launch.quick_exit), but still does what an exit
must: its status, the atexit handlers, the logging handlers' flush, and a wait for a thread still at work."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from primus.core.launch.quick_exit import exit_code


def _run(body: str, tmp_path) -> subprocess.CompletedProcess:
    code = "from primus.core.launch.quick_exit import quick_exit\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)


def test_status_atexit_handlers_logs_and_streams(tmp_path):
    proc = _run(
        """
        import atexit, logging
        atexit.register(lambda: open("atexit", "w").write("ran"))
        logging.basicConfig(filename="log", level=logging.INFO)
        logging.info("kept")
        print("out", end="")  # no newline: still buffered when the process leaves
        quick_exit(3)
        """,
        tmp_path,
    )
    assert proc.returncode == 3 and proc.stdout == "out"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert "kept" in (tmp_path / "log").read_text()


def test_a_thread_still_at_work_is_waited_for(tmp_path):
    proc = _run(
        """
        import threading, time
        def save():
            time.sleep(0.5)
            open("saved", "w").write("all")
        threading.Thread(target=save).start()
        quick_exit(0)
        """,
        tmp_path,
    )
    assert proc.returncode == 0 and (tmp_path / "saved").read_text() == "all"


@pytest.mark.parametrize(("code", "status"), [(None, 0), (0, 0), (2, 2), ("a message", 1)])
def test_exit_codes(code, status, capsys):
    assert exit_code(code) == status
    assert capsys.readouterr().err == ("a message\n" if isinstance(code, str) else "")
