"""Mixed load (`appliance bench serve --long-prompt N`): what a long prompt
costs the streams already running.

``streams`` requests decode (streaming, ``ignore_eos``) until they are
under way; then one prompt of ``long_len`` tokens arrives. Measured: the
long prompt's TTFT, the running streams' largest gap while it waited for
its first token, the tokens they got meanwhile, and their median
inter-token latency before it arrived (the gap's reference). Any
OpenAI-compatible server that takes token-id prompts can be measured
(llama.cpp's ``llama-server`` does).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from typing import Optional

import httpx


async def _stream(client: httpx.AsyncClient, url: str, body: dict, headers: dict, times: list[float],
                  started: asyncio.Event) -> Optional[str]:
    """Stream ``body``, appending each choice chunk's arrival time; an error text or None."""
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                return f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    return f"stream error: {str(chunk['error'].get('message'))[:200]}"
                if chunk.get("choices"):
                    times.append(time.perf_counter())
                    started.set()
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"
    return None


async def mixed_load(url: str, model: Optional[str], stream_prompts: list[list[int]], long_prompt: list[int],
                     output_len: int, headers: dict, warmup_tokens: int = 16, long_output: int = 1) -> dict:
    """``len(stream_prompts)`` streams of ``output_len`` tokens; once each has
    ``warmup_tokens``, the long prompt (``long_output`` output tokens: past
    one, their median gap is its decode's ITL at that context) arrives."""
    def body(prompt: list[int], max_tokens: int) -> dict:
        b = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
        return {**b, "model": model} if model else b

    n = len(stream_prompts)
    limits = httpx.Limits(max_connections=n + 2, max_keepalive_connections=n + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        times: list[list[float]] = [[] for _ in range(n)]
        events = [asyncio.Event() for _ in range(n)]
        tasks = [asyncio.create_task(_stream(client, url, body(p, output_len), headers, t, e))
                 for p, t, e in zip(stream_prompts, times, events)]
        deadline = time.perf_counter() + 600
        while any(len(t) < warmup_tokens for t in times) and time.perf_counter() < deadline:
            if any(t.done() for t in tasks):
                break
            await asyncio.sleep(0.01)
        long_times: list[float] = []
        sent = time.perf_counter()
        long_error = await _stream(client, url, body(long_prompt, long_output), headers, long_times, asyncio.Event())
        # each stream's next token after the long prompt's first closes its last gap; then they can stop
        end = time.perf_counter() + 60
        while long_times and time.perf_counter() < end and not all(
                task.done() or (t and t[-1] > long_times[0]) for task, t in zip(tasks, times)):
            await asyncio.sleep(0.01)
        for task in tasks:
            if not task.done():
                task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        # a string is a stream's own error; an exception one it did not expect (a cancelled stream is neither)
        errors = [e if isinstance(e, str) else f"{type(e).__name__}: {e}" for e in results
                  if isinstance(e, (str, Exception))] + ([long_error] if long_error else [])
    out = {"streams": n, "long_prompt_len": len(long_prompt), "output_len": output_len,
           "long_prompt_tokens": long_output}
    if errors or not long_times:
        return {**out, "error": errors[0] if errors else "the long prompt streamed no token"}
    first = long_times[0]
    before = [b - a for t in times for a, b in zip(t, t[1:]) if b <= sent]
    # the largest gap of any stream across the long prompt's wait: from its last token at or before the
    # arrival (or the arrival) through the tokens it got until the long prompt's first token, and the next one
    gaps, during = [], 0
    for t in times:
        inside = [x for x in t if sent < x <= first]
        after = [x for x in t if x > first][:1]
        marks = [max([x for x in t if x <= sent], default=sent), *inside, *after]
        gaps += [b - a for a, b in zip(marks, marks[1:])]
        during += len(inside)
    itl = statistics.median(before) if before else None
    worst = max(gaps, default=0.0)
    # the long prompt's decode at its whole context: the gaps between its chunks (a server sends none for a token
    # whose text it holds back, such as part of a character; None with fewer than two chunks)
    own = [b - a for a, b in zip(long_times, long_times[1:])]
    return {**out, "long_prompt_ttft_ms": (first - sent) * 1e3,
            "long_prompt_itl_p50_ms": statistics.median(own) * 1e3 if own else None,
            "stream_itl_p50_ms_before": itl * 1e3 if itl else None,
            "worst_stream_gap_ms": worst * 1e3,
            "worst_gap_over_itl": worst / itl if itl else None,
            "stream_tokens_during_prefill": during}
