"""Start a real `appliance run` on 127.0.0.1 for integration tests."""

import json
import os
import subprocess
import threading
from typing import Callable, Optional

import httpx
import zmq

from appliance.server.auth import SIGNATURE_HEADER, sign_request
from appliance.server.local import LocalServer, free_port

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


def post_signed(url: str, body: dict, key: str, **kw) -> httpx.Response:
    """POST ``body`` as this deployment's router sends it: signed with the internal ``key``."""
    content = json.dumps(body).encode()
    headers = {"content-type": "application/json", SIGNATURE_HEADER: sign_request(key.encode(), content)}
    return httpx.post(url, content=content, headers={**headers, **kw.pop("headers", {})}, **kw)


class FakeProducer(threading.Thread):
    """A ZeroMQ endpoint posing as a KV transfer producer: every pull is
    answered with the frames ``answer(pull body)`` gives (None: no answer).
    ``pulls``: how many it received."""

    def __init__(self, answer: Callable[[bytes], Optional[list]]):
        super().__init__(daemon=True)
        self.port, self.answer, self.pulls = free_port(), answer, 0
        self._stop_event = threading.Event()
        self.start()

    def run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(f"tcp://127.0.0.1:{self.port}")
        while not self._stop_event.is_set():
            if not sock.poll(20):
                continue
            ident, kind, *rest = sock.recv_multipart()
            if kind != b"pull" or not rest:
                continue
            self.pulls += 1
            frames = self.answer(rest[0])
            if frames is not None:
                sock.send_multipart([ident, *frames])
        sock.close()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(5)
