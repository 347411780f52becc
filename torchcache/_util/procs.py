"""Child processes of the package's own: started without re-running the user's main module.

multiprocessing's "spawn" re-imports the parent's `__main__` in every child, so a plain script
without an `if __name__ == "__main__":` guard that starts a build would run again in each worker
(and hang or recurse). A child here is a fresh interpreter running only this module; it talks to
its parent over a socket wrapped in a multiprocessing Connection (pickled messages between our
own processes; nothing on disk is ever pickled). A child starts with its parent's test hooks
(see `hooks`).
"""

from __future__ import annotations

import ctypes
import importlib
import os
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any

from . import hooks
_PR_SET_PDEATHSIG = 1
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Child:
    """A running child process and the parent's end of its connection."""

    def __init__(self, process: subprocess.Popen, conn: Connection):
        self.process, self.conn = process, conn

    @property
    def exitcode(self) -> int | None:
        return self.process.poll()

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        if self.is_alive():
            self.process.kill()

    def terminate(self) -> None:
        if self.is_alive():
            self.process.terminate()

    def join(self, timeout: float | None = None) -> int | None:
        """Wait for the child to exit (reaping it, so no zombie is left); its exit code."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        self.conn.close()


def start_child(target: str, *args: Any, die_with_parent: bool = True) -> Child:
    """Run `target` ("module:function") in a fresh interpreter as ``function(conn, *args)``.

    `die_with_parent` makes the child exit when the thread that started it dies (Linux), so a
    killed coordinator leaves no orphan writing into a cache.
    """
    mine, theirs = socket.socketpair()
    # the child finds this package as the parent does; the parent folder is only a fallback
    # (appended, so it never shadows the standard library)
    bootstrap = ("import sys; sys.path.append(sys.argv[1]); import torchcache._util.procs as p; "
                 "p._child_entry()")
    command = [sys.executable, "-c", bootstrap, _PACKAGE_PARENT, str(theirs.fileno()),
               str(os.getpid()) if die_with_parent else "0"]
    try:
        process = subprocess.Popen(command, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
    except BaseException:
        mine.close()
        raise
    finally:
        theirs.close()
    conn = Connection(mine.detach())
    try:
        conn.send((target, args, hooks.values()))
    except BaseException:
        process.kill()
        process.wait()
        conn.close()
        raise
    return Child(process, conn)


def _child_entry() -> None:
    fd, parent = int(sys.argv[2]), int(sys.argv[3])
    if parent:
        _die_with_parent(parent)
    conn = Connection(fd)
    target, args, hook_values = conn.recv()
    hooks.apply(hook_values)
    module, _, function = target.partition(":")
    getattr(importlib.import_module(module), function)(conn, *args)


def _die_with_parent(parent: int) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:  # not glibc Linux: workers still notice a dead parent through their connection
        return
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)
