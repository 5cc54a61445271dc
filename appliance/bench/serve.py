"""`appliance bench serve`: an OpenAI-compatible load client (ours or any
other server), after `vllm bench serve`.

Streams /v1/completions with token-id prompts at each ``--max-concurrency``
(and/or Poisson ``--request-rate``) and reports TTFT, TPOT, ITL and E2E
latency (mean, p50, p90, p99, ms), output tok/s and goodput under TTFT/ITL
SLOs. Without ``--base-url`` it starts `appliance run` on a free loopback
port with the given overrides and stops it afterwards.

``--oversized N`` also measures how much rejecting bad requests costs a
healthy one: one stream's largest inter-token gap alone, then while N
clients (in another process) send, all at once, ``--oversized-rounds``
prompts each (0: until the stream ends) of ``--oversized-chars``
characters that the server must refuse (over ``server.max_prompt_chars``, or tokenized and over
the context length), and while the same clients send the same prompts to a
sink on this host that only reads and refuses them (the floor the host's
shared cores set); medians of ``--oversized-repeats`` runs, with the ratios
to the gap alone and to the sink's. A server that tokenizes on its event
loop stalls every stream while it does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import queue
import random
import statistics
import sys
import time
from collections import Counter
from typing import Any, Optional

import httpx
from tqdm import tqdm

from appliance.bench.common import (percentiles, plot_lines, random_prompts, result_name, server_under_test,
                                    split_overrides, write_results)


async def one_request(client: httpx.AsyncClient, url: str, model: Optional[str], prompt: list[int], output_len: int,
                      headers: dict) -> dict:
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    for attempt in range(2):
        t0 = time.perf_counter()
        times: list[float] = []
        usage = None
        try:
            async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
                if r.status_code != 200:
                    return {"ok": False, "error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("error"):  # the server cut the stream (drain, timeout, engine failure)
                        return {"ok": False, "error": f"stream error: {str(chunk['error'].get('message'))[:200]}"}
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    # Every choice chunk is an arrival, text or not (as vLLM's serving benchmark counts):
                    # a token that ends inside a multi-byte character streams no text yet.
                    if chunk.get("choices"):
                        times.append(time.perf_counter())
            break
        except httpx.RemoteProtocolError as e:
            # A kept-alive connection the server closed as the request went out (no response at
            # all): sent again once, on a new connection, as HTTP clients do.
            if attempt or times:
                return {"ok": False, "error": f"{type(e).__name__}: {e}"}
        except httpx.HTTPError as e:
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    end = time.perf_counter()
    n_out = usage["completion_tokens"] if usage else len(times)
    if not times:
        return {"ok": False, "error": "no tokens streamed"}
    ttft = times[0] - t0
    itl = [b - a for a, b in zip(times, times[1:])]
    tpot = (end - times[0]) / (n_out - 1) if n_out > 1 else 0.0
    return {"ok": True, "ttft": ttft, "itl": itl, "tpot": tpot, "e2e": end - t0, "output_tokens": n_out}


async def run_level(url: str, model: Optional[str], prompts: list[list[int]], output_len: int, concurrency: int,
                    rate: float, headers: dict, seed: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)
    bar = tqdm(total=len(prompts), desc=f"bench serve c={concurrency}", file=sys.stderr)

    async def guarded(client, p):
        async with sem:
            r = await one_request(client, url, model, p, output_len, headers)
        bar.update(1)
        return r

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        tasks = []
        t0 = time.perf_counter()
        for p in prompts:
            tasks.append(asyncio.create_task(guarded(client, p)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
    bar.close()
    return {"results": results, "elapsed_s": elapsed}


OVERSIZED_WORDS = ("token", "budget", "scheduler", "prefill", "decode", "block", "cache", "latency", "stream",
                   "window", "attention", "kernel")


def oversized_text(chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words: list[str] = []
    n = 0
    while n < chars:
        words.append(rng.choice(OVERSIZED_WORDS))
        n += len(words[-1]) + 1
    return " ".join(words)[:chars]


def _flood(url: str, body: bytes, headers: dict, n: int, rounds: int, ready: Any, go: Any, stop: Any,
           results: Any) -> None:
    """Once ``go`` is set, ``n`` concurrent clients, each sending ``body``
    ``rounds`` times, all of them even if the stream has ended (0: again as
    soon as it is answered, until ``stop`` is set); the status counts go to
    ``results``. Runs in a process of its own,
    so its work never delays the measured stream's client."""

    async def run() -> Counter:
        responses: Counter = Counter()
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
            ready.set()
            await asyncio.get_running_loop().run_in_executor(None, go.wait)

            async def loop() -> None:
                sent = 0
                while sent < rounds if rounds else not stop.is_set():
                    sent += 1
                    try:
                        r = await client.post(f"{url}/v1/completions", content=body,
                                              headers={**headers, "Content-Type": "application/json"})
                        responses[str(r.status_code)] += 1
                    except httpx.HTTPError as e:
                        responses[type(e).__name__] += 1

            await asyncio.gather(*[loop() for _ in range(n)])
        return responses

    results.put(dict(asyncio.run(run())))


def _sink(port: int) -> None:
    """An HTTP server on the same stack as ours (uvicorn, h11) that reads
    each body whole and answers 400: what any server must do with the
    flood, so a stream's gap beside it is the floor this host sets."""
    import uvicorn

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        await send({"type": "http.response.start", "status": 400, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"error": {"message": "refused"}}'})

    uvicorn.run(app, host="127.0.0.1", port=port, http="h11", log_level="warning")


async def _gap_beside_flood(client: httpx.AsyncClient, url: str, flood_url: str, model: Optional[str],
                            prompt: list[int], output_len: int, body: bytes, n: int, rounds: int, headers: dict,
                            pause_s: float) -> tuple[dict, Counter]:
    """One stream from ``url`` while ``n`` clients (another process) send
    ``body`` to ``flood_url``; the stream's result and the flood's status counts."""
    ctx = mp.get_context("spawn")
    ready, go, stop, results = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue()
    flood = ctx.Process(target=_flood, args=(flood_url, body, headers, n, rounds, ready, go, stop, results),
                        daemon=True)
    flood.start()
    try:
        if not await asyncio.get_running_loop().run_in_executor(None, ready.wait, 120):
            raise RuntimeError("the oversized-prompt clients did not start")
        stream = asyncio.create_task(one_request(client, url, model, prompt, output_len, headers))
        await asyncio.sleep(pause_s)  # the stream is under way
        go.set()
        loaded = await stream
    finally:
        go.set()
        stop.set()
        try:
            responses = Counter(await asyncio.get_running_loop().run_in_executor(None, results.get, True, 120))
        except queue.Empty:
            responses = Counter({"no result from the clients' process": 1})
        flood.join(10)
    return loaded, responses


def _max_itl_ms(result: dict) -> float:
    return max(result["itl"], default=0.0) * 1e3


async def rejection_gap(url: str, model: Optional[str], prompt: list[int], output_len: int, n: int, chars: int,
                        headers: dict, rounds: int = 1, repeats: int = 3) -> dict:
    """One stream's largest inter-token gap alone, while ``n`` clients (in
    another process) send oversized prompts to the server, ``rounds`` each
    (0: until the stream ends), each answered before the next is sent, and
    while they send the same prompts to a sink on this host that only reads
    and refuses them. The sink run is the floor the host itself sets (the
    clients' and the server's processes share its cores); the server's own
    cost is the ratio to it. Each figure is the median of ``repeats`` runs."""
    from appliance.server.local import free_port

    body = {"prompt": oversized_text(chars), "max_tokens": 1}
    if model:
        body["model"] = model
    raw = json.dumps(body).encode()
    sink_port = free_port()
    sink = mp.get_context("spawn").Process(target=_sink, args=(sink_port,), daemon=True)
    sink.start()
    sink_url = f"http://127.0.0.1:{sink_port}"
    out: dict = {"concurrent_oversized": n, "oversized_rounds": rounds, "oversized_chars": chars,
                 "output_len": output_len, "repeats": repeats}
    runs: dict[str, list[float]] = {"alone": [], "sink": [], "server": []}
    responses: Counter = Counter()
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
            for _ in range(60):
                try:
                    await client.post(sink_url, content=b"{}")
                    break
                except httpx.HTTPError:
                    await asyncio.sleep(0.5)
            else:
                return {**out, "error": "the sink server did not start"}
            for _ in range(repeats):
                alone = await one_request(client, url, model, prompt, output_len, headers)
                if not alone["ok"]:
                    return {**out, "error": alone["error"]}
                runs["alone"].append(_max_itl_ms(alone))
                pause = min(0.25, alone["e2e"] / 4)
                for target, flood_url in (("sink", sink_url), ("server", url)):
                    loaded, counts = await _gap_beside_flood(client, url, flood_url, model, prompt, output_len, raw,
                                                             n, rounds, headers, pause)
                    if target == "server":
                        responses += counts
                    if not loaded["ok"]:
                        return {**out, "responses": dict(responses), "error": loaded["error"]}
                    runs[target].append(_max_itl_ms(loaded))
    finally:
        sink.terminate()
        sink.join(10)
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {**out, "responses": dict(responses), "rejected": responses.get("400", 0) + responses.get("413", 0),
            "max_itl_ms_runs": runs, "max_itl_ms_alone": med["alone"], "max_itl_ms_beside_sink": med["sink"],
            "max_itl_ms_while_rejecting": med["server"],
            "ratio": med["server"] / med["alone"] if med["alone"] else None,
            "ratio_to_sink": med["server"] / med["sink"] if med["sink"] else None}


def summarize(level: dict, concurrency: int, rate: float, ttft_slo_ms: float, itl_slo_ms: float) -> dict:
    ok = [r for r in level["results"] if r["ok"]]
    failed = [r["error"] for r in level["results"] if not r["ok"]]
    elapsed = level["elapsed_s"]
    out_tokens = sum(r["output_tokens"] for r in ok)
    good = [r for r in ok if r["ttft"] * 1e3 <= ttft_slo_ms and all(x * 1e3 <= itl_slo_ms for x in r["itl"])]
    return {
        "max_concurrency": concurrency, "request_rate": None if rate == float("inf") else rate,
        "completed": len(ok), "failed": len(failed), "errors": failed[:5], "elapsed_s": elapsed,
        "output_tok_s": out_tokens / elapsed, "requests_s": len(ok) / elapsed,
        "goodput_requests_s": len(good) / elapsed,
        "ttft_ms": percentiles([r["ttft"] * 1e3 for r in ok]),
        "tpot_ms": percentiles([r["tpot"] * 1e3 for r in ok]),
        "itl_ms": percentiles([x * 1e3 for r in ok for x in r["itl"]]),
        "e2e_ms": percentiles([r["e2e"] * 1e3 for r in ok]),
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="appliance bench serve")
    p.add_argument("--base-url", default=None, help="an OpenAI-compatible server; default: start appliance run")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--max-concurrency", default="1,8,32", help="comma-separated levels (empty: none)")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per level")
    p.add_argument("--input-len", type=int, default=100)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=None, help="token ids are drawn below this (default: the model's)")
    p.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    p.add_argument("--itl-slo-ms", type=float, default=50.0)
    p.add_argument("--oversized", type=int, default=0, metavar="N",
                   help="also measure one stream's largest inter-token gap alone and while N concurrent clients "
                        "send oversized prompts the server rejects")
    p.add_argument("--oversized-chars", type=int, default=100_000, help="characters in each oversized prompt")
    p.add_argument("--oversized-rounds", type=int, default=1,
                   help="oversized prompts each client sends, one after the other (0: until the stream ends)")
    p.add_argument("--oversized-repeats", type=int, default=3,
                   help="runs of the gap measurement (alone, beside a sink, beside the server); medians reported")
    p.add_argument("--long-prompt", type=int, default=0, metavar="N",
                   help="also measure --long-streams running streams while an N-token prompt arrives (appliance.bench.mixed)")
    p.add_argument("--long-streams", type=int, default=4)
    p.add_argument("--long-prompt-tokens", type=int, default=1, metavar="K",
                   help="tokens the long prompt asks for: past one, the median gap between them is its decode's ITL "
                        "at that context")
    p.add_argument("--long-stream-tokens", type=int, default=2048,
                   help="tokens each running stream asks for (it must outlast the long prompt's prefill)")
    p.add_argument("--label", default=None, help="name of the server under test in the results")
    p.add_argument("--out", default="bench-results")
    return p


def _report(levels: list[dict], rejection: Optional[dict], mixed: Optional[dict]) -> None:
    """Each level's figures, then the oversized-rejection and mixed-load measurements, one line each."""
    for lv in levels:
        print(f"c={lv['max_concurrency']:>3}: {lv['output_tok_s']:7.1f} out tok/s, TTFT p50 {lv['ttft_ms']['p50']:.0f} ms "
              f"p99 {lv['ttft_ms']['p99']:.0f} ms, TPOT p50 {lv['tpot_ms']['p50']:.1f} ms, ITL p99 {lv['itl_ms']['p99']:.1f} ms, "
              f"goodput {lv['goodput_requests_s']:.2f} req/s, failed {lv['failed']}")
    if rejection is not None:
        if "error" in rejection:
            print(f"oversized rejection test failed: {rejection['error']}")
        else:
            print(f"largest inter-token gap (median of {rejection['repeats']}): {rejection['max_itl_ms_alone']:.1f} ms "
                  f"alone, {rejection['max_itl_ms_while_rejecting']:.1f} ms while {rejection['concurrent_oversized']} "
                  f"clients sent {rejection['oversized_chars']}-character prompts ({rejection['rejected']} refused with "
                  f"400/413; ratio {rejection['ratio'] or float('nan'):.2f}), "
                  f"{rejection['max_itl_ms_beside_sink']:.1f} ms while they sent them to a sink on this host "
                  f"(ratio to it {rejection['ratio_to_sink'] or float('nan'):.2f})")
    if mixed is not None:
        if "error" in mixed:
            print(f"mixed-load test failed: {mixed['error']}")
        else:
            own = mixed.get("long_prompt_itl_p50_ms")
            print(f"{mixed['long_prompt_len']}-token prompt beside {mixed['streams']} streams: TTFT "
                  f"{mixed['long_prompt_ttft_ms']:.0f} ms" + (f", its own ITL {own:.1f} ms" if own else "") +
                  f"; the streams' worst gap {mixed['worst_stream_gap_ms']:.0f} ms "
                  f"({mixed['worst_gap_over_itl'] or float('nan'):.1f}x their {mixed['stream_itl_p50_ms_before'] or 0:.1f} ms "
                  f"ITL), {mixed['stream_tokens_during_prefill']} tokens meanwhile")


def main(argv: list[str]) -> int:
    p = _parser()
    a, overrides = split_overrides(p, argv)
    if a.oversized_repeats < 1:
        p.error("--oversized-repeats must be at least 1")
    url, own = server_under_test(a.base_url, overrides)
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    try:
        models = httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"]
        model = a.model or models[0]["id"]
        vocab = a.vocab
        if vocab is None:
            from appliance.config.compose import resolve

            vocab = resolve(overrides or ["+profile=cpu"], check=False).cfg.model.vocab_size if own else 32000
        levels = []
        for c in (int(x) for x in a.max_concurrency.split(",") if x.strip()):
            prompts = random_prompts(a.num_prompts, [a.input_len] * a.num_prompts, vocab, seed=c)
            raw = asyncio.run(run_level(url, model, prompts, a.output_len, c, a.request_rate, headers, seed=c))
            levels.append(summarize(raw, c, a.request_rate, a.ttft_slo_ms, a.itl_slo_ms))
        rejection = None
        if a.oversized > 0:
            prompt = random_prompts(1, [a.input_len], vocab, seed=0)[0]
            rejection = asyncio.run(rejection_gap(url, model, prompt, a.output_len, a.oversized, a.oversized_chars,
                                                  headers, a.oversized_rounds, a.oversized_repeats))
        mixed = None
        if a.long_prompt > 0:
            from appliance.bench.mixed import mixed_load

            streams = random_prompts(a.long_streams, [a.input_len] * a.long_streams, vocab, seed=1)
            # a new prompt each run: a server measured twice must not answer it from its prefix cache
            long = random_prompts(1, [a.long_prompt], vocab, seed=time.time_ns())[0]
            mixed = asyncio.run(mixed_load(url, model, streams, long, a.long_stream_tokens, headers,
                                           long_output=a.long_prompt_tokens))
    finally:
        if own:
            own.stop()
    label = a.label or ("appliance" if own else url)
    path = write_results(a.out, result_name("serve", label) if a.label else "serve",
                         {"server": label, "model": model, "input_len": a.input_len, "output_len": a.output_len,
                          "slo": {"ttft_ms": a.ttft_slo_ms, "itl_ms": a.itl_slo_ms}, "levels": levels,
                          **({"oversized_rejection": rejection} if rejection is not None else {}),
                          **({"mixed_load": mixed} if mixed is not None else {})})
    png = plot_lines(a.out, path.stem, f"{label}: output tok/s by concurrency", "max concurrency", "output tok/s",
                     {label: ([lv["max_concurrency"] for lv in levels], [lv["output_tok_s"] for lv in levels])},
                     logx=True) if levels else None
    _report(levels, rejection, mixed)
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return 1 if any(x is not None and "error" in x for x in (rejection, mixed)) else 0
