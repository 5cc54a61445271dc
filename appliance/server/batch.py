"""`appliance run-batch --input requests.jsonl --output results.jsonl
[overrides]`: OpenAI's Batch file format, run offline.

Each input line is ``{"custom_id", "method": "POST", "url", "body"}`` for
``/v1/chat/completions``, ``/v1/completions``, ``/v1/messages`` or
``/v1/responses``. The deployment the overrides describe is started on a
loopback port (``LocalServer``) and every line is sent to it, up to
``--max-concurrency`` at a time, so a line gets exactly what the server
would answer it: its validation, its errors, its response body. Each
output line is ``{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error": null}``, written in the input's order as
soon as the lines before it are done; a line that is no request (not
JSON, another method or URL, a streamed body, a custom_id given twice)
gets ``"response": null`` and an ``error`` instead, and never reaches the
server.

An output that already holds the first k lines' results (a run that was
stopped) is taken up where it ends: a last line cut short is dropped, the
k results are kept as they are, and the run goes on from line k + 1; an
output whose lines do not match the input's custom_ids is refused.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from typing import Optional

import httpx
from tqdm import tqdm

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")


class BatchError(ValueError):
    """The batch cannot run as asked (the output belongs to another input)."""


def _problem(line: str, seen: set) -> tuple[Optional[str], Optional[dict], Optional[str]]:
    """(custom_id, the request, why it is none) of one input line."""
    try:
        req = json.loads(line)
    except ValueError as e:
        return None, None, f"the line is not JSON: {e}"
    if not isinstance(req, dict):
        return None, None, "the line is not a JSON object"
    cid = req.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return None, None, "'custom_id' must be a non-empty string"
    if cid in seen:
        return cid, None, f"'custom_id' {cid[:80]!r} is given twice"
    seen.add(cid)
    if req.get("method", "POST") != "POST" or req.get("url") not in URLS:
        return cid, None, f"'method' must be POST and 'url' one of {', '.join(URLS)}"
    if not isinstance(req.get("body"), dict):
        return cid, None, "'body' must be an object"
    if req["body"].get("stream"):
        return cid, None, "a batch request cannot stream ('stream': true)"
    return cid, req, None


def _done_lines(output: str, custom_ids: list[Optional[str]]) -> int:
    """How many results ``output`` already holds (its last line cut short is dropped from the file)."""
    if not os.path.exists(output):
        return 0
    with open(output, "rb") as f:
        raw = f.read()
    whole = raw[: raw.rfind(b"\n") + 1]
    if len(whole) != len(raw):
        with open(output, "wb") as f:
            f.write(whole)
    lines = whole.decode().splitlines()
    if len(lines) > len(custom_ids):
        raise BatchError(f"{output} holds {len(lines)} results but the input has {len(custom_ids)} lines")
    for i, line in enumerate(lines):
        try:
            cid = json.loads(line).get("custom_id")
        except (ValueError, AttributeError):
            raise BatchError(f"{output} line {i + 1} is not a result this command wrote") from None
        if cid != custom_ids[i]:
            raise BatchError(f"{output} line {i + 1} is for custom_id {cid!r}, the input's line {i + 1} for "
                             f"{custom_ids[i]!r}: it is another batch's output")
    return len(lines)


async def _send(client: httpx.AsyncClient, url: str, req: dict, headers: dict) -> dict:
    try:
        r = await client.post(f"{url}{req['url']}", json=req["body"], headers=headers)
        body = r.json()
    except (httpx.HTTPError, ValueError) as e:
        return {"response": None, "error": {"code": "request_failed", "message": f"{type(e).__name__}: {e}"}}
    return {"response": {"status_code": r.status_code, "request_id": body.get("id") if isinstance(body, dict) else None,
                         "body": body}, "error": None}


def prepare(input_path: str, output_path: str) -> tuple[list, int]:
    """The input's lines as (custom_id, request, problem), and how many results the output already holds."""
    with open(input_path) as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    seen: set = set()
    parsed = [_problem(line, seen) for line in lines]
    return parsed, _done_lines(output_path, [cid for cid, _, _ in parsed])


async def run_batch(url: str, input_path: str, output_path: str, headers: Optional[dict] = None,
                    max_concurrency: int = 64, progress: bool = True,
                    prepared: Optional[tuple[list, int]] = None) -> dict:
    """Every line of ``input_path`` through the server at ``url`` into ``output_path``; what was done.
    ``prepared``: what ``prepare`` made of them, if it ran already."""
    parsed, start = prepared if prepared is not None else prepare(input_path, output_path)
    results: dict[int, dict] = {}
    sem = asyncio.Semaphore(max_concurrency)
    bar = tqdm(total=len(parsed), initial=start, desc="run-batch", disable=not progress)

    async def one(i: int, client: httpx.AsyncClient) -> None:
        cid, req, problem = parsed[i]
        if req is None:
            out = {"response": None, "error": {"code": "invalid_request", "message": problem}}
        else:
            async with sem:
                out = await _send(client, url, req, headers or {})
        results[i] = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": cid, **out}
        bar.update(1)

    written = start
    with open(output_path, "a") as f:
        async with httpx.AsyncClient(timeout=httpx.Timeout(None)) as client:
            tasks = [asyncio.create_task(one(i, client)) for i in range(start, len(parsed))]
            for t in asyncio.as_completed(tasks):
                await t
                while written in results:  # in the input's order, each as soon as those before it are done
                    f.write(json.dumps(results.pop(written), ensure_ascii=False) + "\n")
                    f.flush()
                    written += 1
    bar.close()
    return {"lines": len(parsed), "resumed_at": start, "written": written - start}


def run_batch_cli(input_path: str, output_path: str, overrides: list[str], max_concurrency: int) -> int:
    """Start the deployment on loopback, run the batch through it, stop it."""
    from appliance.server.local import LocalServer

    prepared = parsed, start = prepare(input_path, output_path)  # a wrong output is refused before anything starts
    if start == len(parsed):
        print(f"run-batch: {output_path} already holds all {start} results")
        return 0
    key = f"sk-batch-{uuid.uuid4().hex}"
    server = LocalServer([*overrides, f"server.api_key={key}"], ready_path="/ready")
    try:
        done = asyncio.run(run_batch(server.url, input_path, output_path, {"Authorization": f"Bearer {key}"},
                                     max_concurrency, prepared=prepared))
    finally:
        server.stop()
    print(f"run-batch: {done['written']} results written to {output_path}"
          + (f" after the {done['resumed_at']} already there" if done["resumed_at"] else ""))
    return 0
