"""`appliance run` on a free loopback port, for benchmarks and tests."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Optional

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The first port the kernel hands out to ``bind(0)`` (32768 where it does not say)."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_run(count: int, low: int = 10000, tries: int = 200) -> int:
    """The first of ``count`` consecutive loopback ports that are all free now,
    for a service whose rank ``r`` listens on port + r (``kv_transfer.p2p.port``,
    kv event endpoints over engine cores). The run lies below the kernel's
    ephemeral range, so no port handed out by ``bind(0)`` in the meantime (a
    rank's rendezvous, another server's ``free_port``) can take one of them."""
    high = _ephemeral_low() - count
    if high <= low:
        raise RuntimeError(f"no room for {count} ports between {low} and the ephemeral range")
    for _ in range(tries):
        start = random.randrange(low, high)
        probes = []
        try:
            for port in range(start, start + count):
                probe = socket.socket()
                probes.append(probe)
                probe.bind(("127.0.0.1", port))
            return start
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    raise RuntimeError(f"no {count} consecutive free ports found below {high + count} in {tries} tries")


class LocalServer:
    """Starts the server (``appliance run``, or with ``verb="route"`` the router) in its own
    process group and waits until ``ready_path`` answers 200."""

    def __init__(self, overrides: list[str], ready_path: str = "/health", timeout_s: float = 600,
                 log_path: Optional[str] = None, cwd: Optional[str] = None, env: Optional[dict] = None,
                 verb: str = "run"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path or os.path.join(tempfile.gettempdir(), f"appliance-server-{self.port}.log")
        self.log = open(self.log_path, "w")
        group = "router" if verb == "route" else "server"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "appliance.cli", verb, *overrides, f"{group}.host=127.0.0.1", f"{group}.port={self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd,
            env={**os.environ, **env} if env else None,
        )
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"appliance {verb} exited with {self.proc.returncode}:\n{self.output()[-4000:]}")
            try:
                if httpx.get(f"{self.url}{ready_path}", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"appliance {verb} was not ready after {timeout_s:.0f} s:\n{self.output()[-4000:]}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM to the server process alone (as an orchestrator sends it); its exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(60)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.log.close()
