"""Start a real `appliance run` on 127.0.0.1 for integration tests."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *overrides, startup_timeout=240):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "appliance.cli", "run", "+profile=cpu", f"server.port={self.port}", *overrides]
        self.log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"appliance-server-{self.port}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + startup_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server did not start:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def core_pid(self) -> int:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        for pid in out:
            cmd = open(f"/proc/{pid}/cmdline").read()
            if "spawn_main" in cmd:
                return int(pid)
        raise RuntimeError(f"no engine-core child among {out}")

    def terminate(self, timeout=60) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(30)
            except Exception:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


def metric(text: str, name: str, **labels) -> float:
    total = None
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
    if total is None:
        raise KeyError(name)
    return total
