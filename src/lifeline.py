"""A child process's tie to its parent: it never outlives it, and it names itself.

Every process ringserve starts (engine cores, workers) calls `install_lifeline` first thing:

* `PR_SET_PDEATHSIG` asks the kernel to send SIGKILL when the parent thread dies (Linux only;
  it fires on the death of the *thread* that forked, hence the lifeline as well);
* the lifeline is the read end of a pipe whose write end only the parent holds: a daemon
  thread blocks on it, and EOF, which arrives however the parent died (SIGKILL included),
  ends the child within milliseconds with `os._exit`;
* `setproctitle` renames the process (`ringserve::EngineCore_DP0`, `ringserve::Worker_TP1`) so
  operators and tests find it with `ps`.

The parent side is `Lifeline.create()`: pass `child_fd` to the child (`pass_fds`), keep the
write end, and close it (or die) to end the child.

Stopping: a parent stops its child with `STOP_SIGNAL`, never with SIGTERM or SIGINT. Those two
reach every process at once when the whole process group or cgroup is signalled (a terminal's
Ctrl-C, `kill 0`, systemd's default `KillMode=control-group`, container runtimes), and a child
that died of them would die under its parent's drain (the server would see its engine core
die and fail the streams it was finishing). So every child calls `ignore_group_signals()`:
its parent, having drained, stops it in order, and the lifeline still ends it if the parent
dies.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from dataclasses import dataclass

_PR_SET_PDEATHSIG = 1

STOP_SIGNAL = signal.SIGUSR2
"""The signal a parent sends its child to stop it (see the module docstring). Nothing signals
a whole group or cgroup with it."""

GROUP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""What a stop of the whole group or cgroup sends: a child ignores them."""


@dataclass
class Lifeline:
    """The parent's half of a lifeline pipe.

    Attributes:
        child_fd: the read end, to be inherited by the child (then closed here).
        parent_fd: the write end, held by the parent only; closing it ends the child.
    """

    child_fd: int
    parent_fd: int

    @classmethod
    def create(cls) -> Lifeline:
        """A new pipe; the write end is not inheritable, the read end is."""
        read_fd, write_fd = os.pipe()
        os.set_inheritable(read_fd, True)
        return cls(child_fd=read_fd, parent_fd=write_fd)

    def child_started(self) -> None:
        """Close the parent's copy of the child's end once the child holds it."""
        if self.child_fd >= 0:
            os.close(self.child_fd)
            self.child_fd = -1

    def cut(self) -> None:
        """Close the write end: the child sees EOF and exits."""
        if self.parent_fd >= 0:
            os.close(self.parent_fd)
            self.parent_fd = -1


def set_process_title(title: str) -> None:
    """Name this process for `ps` / `top` (argv-based title and the kernel comm name)."""
    import setproctitle

    setproctitle.setproctitle(title)
    setproctitle.setthreadtitle(title[:15])


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send `sig` to this process when its parent dies (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")


def ignore_group_signals() -> None:
    """Ignore SIGTERM and SIGINT in this child process: its parent stops it (`STOP_SIGNAL`).

    A Python handler that does nothing rather than `SIG_IGN`, which `exec` would hand down to
    the processes this one starts (Ray's, compile workers) and so keep their owners' SIGTERM
    from stopping them.
    """
    for signum in GROUP_SIGNALS:
        signal.signal(signum, _ignore)


def _ignore(signum: int, frame: object) -> None:
    """A group's SIGTERM / SIGINT: the parent decides when this process stops."""


def install_lifeline(lifeline_fd: int | None, expected_parent: int, title: str | None = None) -> None:
    """Tie this (child) process to its parent; exits at once if the parent is already gone.

    Args:
        lifeline_fd: the inherited read end of the parent's lifeline pipe (None: signal only).
        expected_parent: the parent's pid, to catch a parent that died before the prctl.
        title: the process title to set, if any.
    """
    if title is not None:
        set_process_title(title)
    set_parent_death_signal()
    if os.getppid() != expected_parent:
        os._exit(1)
    if lifeline_fd is None:
        return
    thread = threading.Thread(target=_watch, args=(lifeline_fd,), name="ringserve-lifeline",
                              daemon=True)
    thread.start()


def _watch(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass
    # EOF: the parent is gone. No cleanup can be trusted to finish; leave now.
    os._exit(1)


def peek_exit_status(pid: int) -> tuple[bool, int | None]:
    """Whether child `pid` has exited, and its status (negative: the signal), without reaping
    it: its `Popen.wait` thread does that.

    Returns:
        (False, None) while it runs; (True, status) once it has exited, status None when it
        was reaped meanwhile (read `Popen.returncode` then).
    """
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True, None
    if info is None:
        return False, None
    if info.si_code == os.CLD_EXITED:
        return True, info.si_status
    return True, -info.si_status
