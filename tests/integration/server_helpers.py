"""Start a real `appliance run` on 127.0.0.1 for integration tests."""

import os
import subprocess

from appliance.server.local import LocalServer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ServerProcess(LocalServer):
    def __init__(self, *overrides, startup_timeout=240, env=None):
        super().__init__(["+profile=cpu", *overrides], timeout_s=startup_timeout, cwd=REPO, env=env)

    def core_pids(self) -> list[int]:
        """The engine-core processes (one per data-parallel rank, in no particular order)."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        pids = []
        for pid in out:
            try:
                with open(f"/proc/{pid}/cmdline") as f:
                    if "spawn_main" in f.read():
                        pids.append(int(pid))
            except FileNotFoundError:  # exited meanwhile
                pass
        return pids

    def core_pid(self) -> int:
        pids = self.core_pids()
        if not pids:
            raise RuntimeError("no engine-core child")
        return pids[0]


def metric(text: str, name: str, **labels) -> float:
    total = None
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
    if total is None:
        raise KeyError(name)
    return total
