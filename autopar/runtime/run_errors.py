"""``autopar run``: tell a deterministic error from a process failure, and restart only on the latter.

torchrun restarts every worker whenever one exits badly, so a script that raises the same
``ConstraintError`` at every start was run ``1 + --max-restarts`` times, each printing a
traceback per rank. Under ``autopar run`` (``$AUTOPAR_RUN_STATE_DIR`` set):

* a worker (``report_deterministic_errors``, installed when ``autopar.runtime.launch`` is
  imported) whose script leaves uncaught an autopar error other than a lost peer
  (``CollectiveError``) or a failed worker (``WorkerFailedError``) writes it, with its traceback,
  to ``deterministic-rank<R>.txt`` in that folder and waits to be stopped instead of exiting
  (an exit is what torchrun would restart);
* the launcher (``TorchrunWatch``) sees the report, gives the other ranks a moment to report
  theirs, stops torchrun (which stops its workers, restarting none), prints the error once with
  the ranks that raised it, and exits with ``DETERMINISTIC_EXIT``.

Anything else (a rank killed, crashed, or an exception autopar did not raise) is torchrun's to
restart as before. Nothing here holds state between calls.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

__all__ = ["RUN_STATE_ENV", "DETERMINISTIC_EXIT", "report_deterministic_errors", "is_deterministic", "TorchrunWatch"]

RUN_STATE_ENV = "AUTOPAR_RUN_STATE_DIR"
DETERMINISTIC_EXIT = 2  # as ``autopar``'s own refusals
REPORT_PREFIX = "deterministic-rank"
# how long the other ranks may take to report the same error once one has (they all run the same
# setup), and how long a reporting worker waits to be stopped before it exits by itself
OTHERS_GRACE_S = 3.0
STOP_WAIT_S = 120.0
POLL_S = 0.05


def is_deterministic(exc: BaseException) -> bool:
    """An error a restart would raise again: autopar's, except a lost peer or a failed worker."""
    from autopar.errors import AutoparError, CollectiveError, WorkerFailedError

    return isinstance(exc, AutoparError) and not isinstance(exc, (CollectiveError, WorkerFailedError))


def report_deterministic_errors() -> None:
    """Under ``autopar run``: chain ``sys.excepthook`` so that a deterministic error is reported
    to the launcher (module docstring); a no-op elsewhere, and when already installed."""
    folder = os.environ.get(RUN_STATE_ENV)
    if not folder or getattr(sys.excepthook, "autopar_run", False):
        return
    previous = sys.excepthook

    def hook(kind, exc, tb):
        if not is_deterministic(exc) or not os.path.isdir(folder):
            return previous(kind, exc, tb)
        rank = os.environ.get("RANK", "0")
        text = "".join(traceback.format_exception(kind, exc, tb))
        path = Path(folder) / f"{REPORT_PREFIX}{rank}.txt"
        partial = path.with_suffix(".partial")
        partial.write_text(text)
        partial.replace(path)  # the launcher reads whole reports only
        time.sleep(STOP_WAIT_S)  # the launcher stops torchrun within seconds
        sys.stderr.write(text)
        sys.stderr.flush()
        os._exit(DETERMINISTIC_EXIT)

    hook.autopar_run = True
    sys.excepthook = hook


class TorchrunWatch:
    """Run torchrun's command ``cmd``, relaying its stderr, until it ends or a rank reports a
    deterministic error (then stop it: module docstring). ``run()`` returns the exit code."""

    def __init__(self, cmd: list[str], env: dict, folder: str, nproc: int):
        self.cmd, self.env, self.folder, self.nproc = cmd, env, Path(folder), nproc
        self.quiet = threading.Event()  # set once torchrun is being stopped: its noise is not relayed

    def run(self) -> int:
        proc = subprocess.Popen(self.cmd, env=self.env, stderr=subprocess.PIPE)
        relay = threading.Thread(target=self._relay, args=(proc.stderr,), daemon=True)
        relay.start()
        reports = {}
        try:
            while proc.poll() is None:
                reports = self._reports()
                if reports:
                    break
                time.sleep(POLL_S)
            if reports:
                deadline = time.monotonic() + OTHERS_GRACE_S
                while len(reports) < self.nproc and time.monotonic() < deadline and proc.poll() is None:
                    time.sleep(POLL_S)
                    reports = self._reports()
                self.quiet.set()
                self._stop(proc)
        finally:
            if proc.poll() is None:
                self._stop(proc)
            relay.join(timeout=5)
        if not reports:
            return proc.returncode
        sys.stderr.write(self._summary(reports))
        sys.stderr.flush()
        return DETERMINISTIC_EXIT

    def _reports(self) -> dict[int, str]:
        out = {}
        for path in self.folder.glob(f"{REPORT_PREFIX}*.txt"):
            try:
                out[int(path.stem[len(REPORT_PREFIX):])] = path.read_text()
            except (OSError, ValueError):
                continue
        return out

    def _relay(self, pipe) -> None:
        out = getattr(sys.stderr, "buffer", None)
        for line in iter(pipe.readline, b""):
            if self.quiet.is_set():
                continue
            if out is not None:
                out.write(line)
                out.flush()
            else:
                sys.stderr.write(line.decode(errors="replace"))
        pipe.close()

    @staticmethod
    def _stop(proc) -> None:
        proc.terminate()  # torchrun stops its workers on SIGTERM, restarting none
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    @staticmethod
    def _summary(reports: dict[int, str]) -> str:
        first = min(reports)
        last = reports[first].strip().splitlines()[-1] if reports[first].strip() else "?"
        same = [r for r in sorted(reports) if r != first and reports[r].strip().splitlines()[-1:] == [last]]
        other = [r for r in sorted(reports) if r != first and r not in same]
        lines = [reports[first].rstrip(), "",
                 f"autopar run: rank {first} raised this error" + (f" (ranks {', '.join(map(str, same))} the same)"
                                                                   if same else "")
                 + ". It is deterministic (a constraint, plan, input or setting autopar refused): a restart would "
                 "raise it again, so no worker was restarted (--max-restarts is for killed or crashed ranks). "
                 "Fix what it names and run again."]
        for r in other:
            lines.append(f"rank {r} raised: {reports[r].strip().splitlines()[-1]}")
        return "\n".join(lines) + "\n"
