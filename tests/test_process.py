"""bootseer.process: the one answer to "is this pid alive", "who is in this group", "what is
signal N called", asked of real processes (a child left a zombie, a reaped one, a group)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from bootseer.process import (
    alive,
    exit_code,
    group_pids,
    pid_alive,
    proc_state,
    signal_name,
    since_boot,
    started_at,
)


def test_a_zombie_exists_but_does_not_run_and_a_reaped_pid_is_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while (st := proc_state(child.pid)) is not None and st[0] != "Z":
        assert time.monotonic() < deadline, "the child never exited"
        time.sleep(0.01)
    assert alive(child.pid)  # kill(pid, 0): the zombie is still there
    assert not pid_alive(child.pid)  # but it runs no more
    child.wait()
    assert not alive(child.pid)
    assert not pid_alive(child.pid)
    assert proc_state(child.pid) is None


def test_this_process_is_alive_and_started_before_now() -> None:
    assert alive(os.getpid()) and pid_alive(os.getpid())
    born = started_at(os.getpid())
    assert born is not None and 0 < born <= since_boot()
    assert started_at(2**22 + 1) is None  # above pid_max: unreadable


def test_group_pids_lists_the_live_members_of_a_group() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True
    )
    try:
        assert group_pids(child.pid) == {child.pid}
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    assert group_pids(child.pid) == set()


def test_signal_names_and_exit_codes_as_a_shell_reports_them() -> None:
    assert signal_name(15) == "SIGTERM"
    assert signal_name(200) == "200"
    child = subprocess.Popen([sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"])
    _, status = os.waitpid(child.pid, 0)
    child.returncode = -9
    assert exit_code(status) == 137
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    _, status = os.waitpid(child.pid, 0)
    child.returncode = 3
    assert exit_code(status) == 3
