"""`appliance bench apis`: what the Messages and Responses APIs cost over
chat completions, on one server in one run.

The same text prompts, greedy, streamed, at each ``--max-concurrency``,
through ``/v1/chat/completions``, ``/v1/messages`` and ``/v1/responses`` in
turn (each API's levels one after the other, the APIs alternating
``--rounds`` times so drift on the host lands on all of them). The three
render a prompt to the same tokens, so each prompt is prefilled once
first, and every API then finds the same prefix cache; the outputs are the
same tokens. Each API's arrivals are its text deltas, its output tokens
the usage it reports.
Reports output tok/s, TTFT and ITL per API and level (the best round's
tok/s, its latencies), and each API's tok/s over chat's. Without
``--base-url`` it starts `appliance run` with the given overrides.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Optional

import httpx

from appliance.bench.common import percentiles, plot_lines, server_under_test, split_overrides, write_results
from appliance.bench.serve import oversized_text

APIS = ("chat", "messages", "responses")


def request(api: str, model: str, prompt: str, output_len: int) -> tuple[str, dict]:
    """(path, body) of a greedy streamed request for ``prompt`` through ``api``."""
    ask = [{"role": "user", "content": prompt}]
    if api == "chat":
        return "/v1/chat/completions", {"model": model, "messages": ask, "max_tokens": output_len, "temperature": 0,
                                        "stream": True, "stream_options": {"include_usage": True}}
    if api == "messages":
        return "/v1/messages", {"model": model, "messages": ask, "max_tokens": output_len, "temperature": 0,
                                "stream": True}
    return "/v1/responses", {"model": model, "input": prompt, "max_output_tokens": output_len, "temperature": 0,
                             "stream": True}


def read_event(api: str, chunk: dict) -> tuple[bool, Optional[int], Optional[str]]:
    """(a text arrival, the output tokens when this event reports them, an error) of one streamed event."""
    if api == "chat":
        if chunk.get("error"):
            return False, None, str(chunk["error"].get("message"))
        usage = chunk.get("usage")
        text = any(c.get("delta", {}).get("content") for c in chunk.get("choices") or ())
        return text, usage["completion_tokens"] if usage else None, None
    kind = chunk.get("type", "")
    if kind == "error":
        return False, None, str(chunk.get("error", chunk).get("message"))
    if api == "messages":
        done = chunk["usage"]["output_tokens"] if kind == "message_delta" else None
        return kind == "content_block_delta", done, None
    done = chunk["response"]["usage"]["output_tokens"] if kind in ("response.completed", "response.incomplete") \
        else None
    return kind.endswith(".delta"), done, None


async def one(client: httpx.AsyncClient, url: str, api: str, model: str, prompt: str, output_len: int,
              headers: dict) -> dict:
    path, body = request(api, model, prompt, output_len)
    t0 = time.perf_counter()
    times: list[float] = []
    out = None
    async with client.stream("POST", f"{url}{path}", json=body, headers=headers) as r:
        if r.status_code != 200:
            return {"ok": False, "error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            arrival, tokens, error = read_event(api, json.loads(line[6:]))
            if error is not None:
                return {"ok": False, "error": error[:200]}
            if arrival:
                times.append(time.perf_counter())
            out = tokens if tokens is not None else out
    if not times or out is None:
        return {"ok": False, "error": "no text or no usage streamed"}
    return {"ok": True, "ttft": times[0] - t0, "itl": [b - a for a, b in zip(times, times[1:])],
            "output_tokens": out, "e2e": time.perf_counter() - t0}


async def level(url: str, api: str, model: str, prompts: list[str], output_len: int, concurrency: int,
                headers: dict) -> dict:
    sem = asyncio.Semaphore(concurrency)

    async def guarded(client: httpx.AsyncClient, p: str) -> dict:
        async with sem:
            return await one(client, url, api, model, p, output_len, headers)

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(guarded(client, p) for p in prompts))
        elapsed = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    return {"api": api, "max_concurrency": concurrency, "completed": len(ok), "failed": len(results) - len(ok),
            "errors": [r["error"] for r in results if not r["ok"]][:3], "elapsed_s": elapsed,
            "output_tokens": sum(r["output_tokens"] for r in ok),
            "output_tok_s": sum(r["output_tokens"] for r in ok) / elapsed,
            "ttft_ms": percentiles([r["ttft"] * 1e3 for r in ok]),
            "itl_ms": percentiles([x * 1e3 for r in ok for x in r["itl"]])}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="appliance bench apis")
    p.add_argument("--base-url", default=None, help="a server with all three APIs; default: start appliance run")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--max-concurrency", default="1,8", help="comma-separated levels")
    p.add_argument("--num-prompts", type=int, default=16, help="requests per level")
    p.add_argument("--input-words", type=int, default=60)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="times the APIs alternate")
    p.add_argument("--out", default="bench-results")
    return p


def main(argv: list[str]) -> int:
    p = _parser()
    a, overrides = split_overrides(p, argv)
    url, own = server_under_test(a.base_url, overrides)
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    levels = [int(x) for x in a.max_concurrency.split(",") if x.strip()]
    runs: dict[tuple[str, int], list[dict]] = {}
    try:
        model = httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        prompts = {c: [oversized_text(a.input_words * 7, seed=c * 1000 + i) for i in range(a.num_prompts)]
                   for c in levels}
        # every API renders a prompt to the same tokens: one prefill of each first, so that no API finds
        # the prefix cache warmer than another
        warm = asyncio.run(level(url, "chat", model, [p for ps in prompts.values() for p in ps], 1, 8, headers))
        if warm["failed"]:
            raise RuntimeError(f"the warm-up failed: {warm['errors']}")
        for _ in range(a.rounds):
            for api in APIS:
                for c in levels:
                    runs.setdefault((api, c), []).append(asyncio.run(
                        level(url, api, model, prompts[c], a.output_len, c, headers)))
    finally:
        if own:
            own.stop()
    best = {k: max(v, key=lambda x: x["output_tok_s"]) for k, v in runs.items()}
    for (api, c), lv in best.items():
        chat = best[("chat", c)]["output_tok_s"]
        lv["vs_chat"] = lv["output_tok_s"] / chat if chat else None
        lv["rounds_tok_s"] = [x["output_tok_s"] for x in runs[(api, c)]]
    path = write_results(a.out, "apis", {"model": model, "input_words": a.input_words, "output_len": a.output_len,
                                         "levels": list(best.values())})
    png = plot_lines(a.out, path.stem, "output tok/s by API", "max concurrency", "output tok/s",
                     {api: (levels, [best[(api, c)]["output_tok_s"] for c in levels]) for api in APIS}, logx=True)
    for lv in best.values():
        print(f"{lv['api']:>9} c={lv['max_concurrency']:>3}: {lv['output_tok_s']:7.1f} out tok/s "
              f"({lv['vs_chat']:.3f}x chat), TTFT p50 {lv['ttft_ms']['p50']:.0f} ms, ITL p50 "
              f"{lv['itl_ms']['p50']:.1f} ms, failed {lv['failed']}")
    print(f"wrote {path} and {png}")
    return 1 if any(lv["failed"] for lv in best.values()) else 0
