"""`tokenflow serve` as a subprocess of a test: its own process group, its stderr lines."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil


class ServeProcess:
    """Owns one `tokenflow serve` subprocess (its own process group) and its stderr lines."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.lines: list[str] = []
        self._ray_tmp = env.get("RAY_TMPDIR")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenflow.cli", "serve", *args], env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip())

    def wait_for(self, text: str, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} from tokenflow serve:\n" + self.output)
            time.sleep(0.2)

    @property
    def output(self) -> str:
        if self.proc.poll() is not None:
            # Its last lines may still be in the pipe when `wait()` returns: read them (EOF
            # comes when every process holding its stderr has gone; bounded, in case one lives).
            self._reader.join(timeout=10)
        return "\n".join(self.lines)

    def worker_stderr(self) -> str:
        """What its cluster's worker processes (Serve replicas among them) wrote to stderr,
        when the cluster has a temp dir of its own (`RAY_TMPDIR`)."""
        assert self._ray_tmp, "the cluster shares Ray's default temp dir"
        files = sorted(Path(self._ray_tmp).glob("ray/session_*/logs/worker-*.err"))
        return "\n".join(f.read_text(errors="replace") for f in files)

    def ray_processes(self) -> list[psutil.Process]:
        return self.processes_named("raylet") + self.processes_named("gcs_server")

    def processes_named(self, name: str) -> list[psutil.Process]:
        """Its live descendants whose executable is called `name`."""
        return [p for p, cmdline in self.descendants(name)
                if cmdline and Path(cmdline.split()[0]).name == name]

    def descendants(self, fragment: str = "") -> list[tuple[psutil.Process, str]]:
        """Its live descendants whose command line contains `fragment`, with that line.
        A process that exits while we look is skipped (Ray starts and reaps workers all the
        time: reading a vanished one's cmdline raises)."""
        found = []
        for proc in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                cmdline = " ".join(proc.cmdline())
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
            if fragment in cmdline:
                found.append((proc, cmdline))
        return found

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=120)
        self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        kill_tree(self.proc)


def kill_tree(proc: subprocess.Popen) -> None:
    """Kill a process we started, its process group and every descendant, then reap it."""
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for p in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    proc.wait(timeout=30)
