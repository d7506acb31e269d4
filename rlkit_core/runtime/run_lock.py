# pyright: standard
"""One run per output folder: `<output_dir>/rlkit.lock` names the process that holds the folder.

Two runs writing into one folder interleave their metrics and overwrite each other's checkpoints,
so a run holds the folder's lock from before it reads the folder until it ends. The lock file is
made whole in one step (a hard link to a finished temporary file, which fails if the lock exists),
so a second run always finds a complete holder to name: process id, host and start time.

A process killed without the chance to remove its lock (SIGKILL, a power cut) leaves it behind.
Such a lock is stale when its host is this one and its process is no longer running (or its pid
now belongs to a process started later); a new run then takes it over and says so. A lock from
another host cannot be checked from here and is never taken over: the message says how to remove
it by hand. Take-overs on one host go one at a time (a short file lock in the temporary folder),
so two runs finding the same stale lock cannot both take it.

Only the main process of a launch takes the lock (`RANK` 0 under torchrun or accelerate launch);
the others write nothing of their own there, and if the main process is refused, the launcher
ends them with it.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import attrs
from filelock import FileLock

from rlkit_core.errors import RlkitError

LOCK = "rlkit.lock"


@attrs.frozen
class Holder:
    pid: int
    host: str
    started: str  # when the run started, local time, for the message
    process_start: str | None = None  # the kernel's start time of the process: tells a reused pid apart

    @classmethod
    def this_process(cls) -> Holder:
        return cls(os.getpid(), socket.gethostname(), time.strftime("%Y-%m-%d %H:%M:%S %Z"), _process_start(os.getpid()))

    def __str__(self) -> str:
        return f"process {self.pid} on {self.host}, started {self.started}"


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux /proc); None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the command name before ")" may hold spaces


def running(holder: Holder) -> bool:
    """Whether the lock's process may still be running: always True for another host's lock."""
    if holder.host != socket.gethostname():
        return True
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: running
        pass
    started = _process_start(holder.pid)
    return not (holder.process_start and started and started != holder.process_start)


def read_holder(path: Path) -> Holder | None:
    """The lock's holder; None when there is no lock. An unreadable lock raises the located error."""
    try:
        return Holder(**json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        raise RlkitError(f"{path}: a lock file rlkit cannot read ({exc}); if no run is using {path.parent}, delete "
                         "the file and start again") from None


def launched_as_main() -> bool:
    """Whether this process is the main one of its launch (torchrun and accelerate set RANK)."""
    return os.environ.get("RANK", "0") == "0"


class RunLock:
    """The lock of one output folder, held by this process between `acquire` and `release`."""

    def __init__(self, output_dir: str | Path):
        self.folder = Path(output_dir)
        self.path = self.folder / LOCK
        self.holder = Holder.this_process()
        self.made_folder = False
        self.held = False

    def acquire(self) -> str:
        """Take the lock; returns a line for the user when a stale lock was taken over (else "").
        Raises the located error naming the holder when another run holds the folder."""
        self.made_folder = not self.folder.exists()
        self.folder.mkdir(parents=True, exist_ok=True)
        temporary = self.folder / f".{LOCK}.{self.holder.pid}"
        temporary.write_text(json.dumps(attrs.asdict(self.holder)))
        try:
            note = self._link(temporary)
        except BaseException:
            self._remove_folder_if_made()
            raise
        finally:
            temporary.unlink(missing_ok=True)
        self.held = True
        return note

    def _link(self, temporary: Path) -> str:
        try:
            os.link(temporary, self.path)
            return ""
        except FileExistsError:
            pass
        guard = Path(tempfile.gettempdir()) / f"rlkit-lock-{hashlib.sha256(str(self.path.resolve()).encode()).hexdigest()[:16]}"
        with FileLock(str(guard), timeout=60):
            holder = read_holder(self.path)
            if holder is not None and running(holder):
                raise self._refusal(holder)
            self.path.unlink(missing_ok=True)
            try:
                os.link(temporary, self.path)
            except FileExistsError:  # another host's run took it in between
                raise self._refusal(read_holder(self.path)) from None
        if holder is None:
            return ""
        return (f"took over the lock of {self.folder} from {holder}, which is no longer running (it ended without "
                "releasing it: a crash or SIGKILL)")

    def _refusal(self, holder: Holder | None) -> RlkitError:
        other_host = holder is not None and holder.host != socket.gethostname()
        remove = (f"; rlkit cannot see processes on {holder.host}: if that run has ended, delete {self.path}"
                  if other_host and holder is not None else "")
        return RlkitError(f"{self.folder} is in use by another run ({holder}; lock file {self.path}): wait for it to end "
                          f"or stop it, or pick another folder with --set run.output_dir=...{remove}")

    def release(self) -> None:
        """Remove the lock if this process holds it; a folder the lock made and nothing else used goes too."""
        if not self.held:
            return
        self.held = False
        try:
            if read_holder(self.path) == self.holder:
                self.path.unlink()
        except (OSError, RlkitError) as exc:
            print(f"rlkit run: warning: could not remove the lock {self.path}: {exc}", file=sys.stderr)
        self._remove_folder_if_made()

    def _remove_folder_if_made(self) -> None:
        if self.made_folder:
            try:
                self.folder.rmdir()  # only if empty
            except OSError:
                pass

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
