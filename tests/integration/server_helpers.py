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


class ScriptedClient:
    """Stands in for EngineClient: every request plays ``script`` (deltas; an
    exception in it is raised there). ``requests``: (prompt token ids,
    sampling params) of each request, in order."""

    def __init__(self, script, dead=False):
        from appliance.engine.outputs import StepStats
        from appliance.server.messages import Ready

        self.script, self.dead = script, dead
        self.dead_reason = "IndexError: index 99999999 is out of bounds for dimension 0 with size 512"
        self.restarting, self.down_reason = False, ""
        self.lost, self.serving = False, not dead
        self.stats, self.ready_info = StepStats(), Ready(num_kv_blocks=1, block_size=16, backend="torch_sdpa", pid=1)
        self.requests = []

    def unresponsive_reason(self):
        return None

    async def generate(self, request_id, prompt_token_ids, params, priority=0, cache_salt=None,
                       data_parallel_rank=None):
        from appliance.engine.outputs import RequestOutputDelta

        self.requests.append((prompt_token_ids, params))
        for item in self.script:
            if isinstance(item, Exception):
                raise item
            yield RequestOutputDelta(**{"request_id": request_id, "new_token_ids": [1], "new_text": "",
                                        "finished": False, "num_prompt_tokens": 1, "num_output_tokens": 1, **item})

    def pick_rank(self, pinned=None):
        return 0

    def abort_nowait(self, request_ids):
        pass


def scripted_front_end(overrides):
    """``make(client)``: the HTTP app of the tiny random model with
    ``overrides``, in-process (litestar's TestClient), over ``client``
    (a ``ScriptedClient``); and the tokenizer it serves with."""
    from unittest.mock import MagicMock

    from litestar.testing import TestClient

    from appliance.config.compose import resolve
    from appliance.models.loader import load_tokenizer
    from appliance.runner import compose
    from appliance.server.app import ServerState, create_app

    resolved = resolve(["+profile=cpu", "model=tiny_random", *overrides])
    tokenizer = load_tokenizer(resolved.cfg.model)

    def make(client):
        state = ServerState(deployment=compose(resolved, here=False), client=client, tokenizer=tokenizer,
                            metrics=MagicMock(), api_keys=())
        return TestClient(app=create_app(state))

    make.tokenizer = tokenizer
    return make
