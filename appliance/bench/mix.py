"""`appliance bench mix`: a seeded mix of real requests for a fixed time.

``--clients`` clients each send one request after another for
``--duration`` seconds against any OpenAI-compatible server (``--base-url``;
without it `appliance run` starts with the given overrides). Each client
draws its requests from the mix with its own seeded generator, so every
server is sent the same sequence by each client, as far as it gets:

- 30% completions of a 20-, 200- or 1,500-word prompt, 8 or 64 tokens;
- 20% chat constrained to a JSON schema (``response_format``), 64 tokens;
- 15% chat with ``n=2`` (sampled, seeded), 32 tokens;
- 35% streamed completions of a 300-word prompt that the client cuts after
  2 or 5 tokens or reads to the end (200 tokens).

Prompts are fresh random words (nothing repeats for a prefix cache to
find). The usage comes from the responses; a stream asks for
``stream_options.continuous_usage_stats``, so one cut early still counts its
prompt and what it got (against a server without it, the prompt tokens of
cut streams are reported unknown). Counted: the requests that completed
before the deadline (those still running then are cut and reported apart),
their prompt and generated tokens per second, latency percentiles per kind,
errors per kind, and whether each finished JSON answer parses and keeps to
its schema. ``--verify K`` then sends K of the greedy requests again, one at
a time on the idle server, and reports how many answers the load changed
(a batched step may round differently from a lone one: a change is
reported with where the texts part, not failed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Optional

import httpx

from appliance.bench.common import (percentiles, plot_bars, result_name, server_under_test, split_overrides,
                                    write_results)

WORDS = (
    "the of and to in is was for that with as on by at from his her they this which are have had not were but "
    "be one all their there been when who will more would what can out about into them time only other new "
    "some could these two may first then do any like my now over such our man me even most made after also "
    "did many before must through back years where much your way well down should because each just those "
    "people how too little state good very make world still own see men work long get here between both life "
    "being under never day same another know while last might us great old year off come since against go "
    "came right used take three house river garden window market engine kernel budget cache latency stream "
    "prompt token number system water city paper light music story table letter morning evening summer winter "
    "mountain station bridge village school doctor animal forest ocean island harbor valley silver copper"
).split()

# A small record a model of any size can finish in 64 tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class MixRequest:
    kind: str  # "completion", "json_chat", "chat_n2", "stream"
    path: str
    body: dict
    cut_after: Optional[int] = None  # a stream: tokens read before the client hangs up (None: to the end)
    greedy: bool = True

    def with_model(self, model: Optional[str]) -> dict:
        return {**self.body, "model": model} if model else dict(self.body)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _scaled(n: int, scale: float) -> int:
    return max(1, round(n * scale))


def draw(rng: random.Random, scale: float = 1.0) -> MixRequest:
    """The next request of the mix (``scale`` shrinks every length, for a quick run)."""
    u = rng.random()
    if u < 0.30:
        words, max_tokens = rng.choice((20, 200, 1500)), rng.choice((8, 64))
        return MixRequest("completion", "/v1/completions",
                          {"prompt": _words(rng, _scaled(words, scale)), "max_tokens": _scaled(max_tokens, scale),
                           "temperature": 0})
    if u < 0.50:
        text = _words(rng, _scaled(40, scale))
        return MixRequest("json_chat", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": f"Describe a person in JSON. Notes: {text}"}],
            "max_tokens": _scaled(64, scale), "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}})
    if u < 0.65:
        text = _words(rng, _scaled(60, scale))
        return MixRequest("chat_n2", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": f"Write two short lines about: {text}"}],
            "max_tokens": _scaled(32, scale), "n": 2, "temperature": 1.0, "seed": rng.randrange(1 << 30)},
            greedy=False)
    cut = rng.choice((2, 5, None))
    return MixRequest("stream", "/v1/completions", {
        "prompt": _words(rng, _scaled(300, scale)), "max_tokens": _scaled(200, scale), "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        cut_after=cut)


@dataclass
class Outcome:
    kind: str
    ok: bool
    e2e_s: float
    prompt_tokens: Optional[int] = None
    generated_tokens: int = 0
    ttft_s: Optional[float] = None
    itl_s: list[float] = field(default_factory=list)
    text: Optional[str] = None  # the first choice's text (greedy kinds)
    finish_reason: Optional[str] = None
    error: Optional[str] = None


def _error(kind: str, t0: float, what: str) -> Outcome:
    return Outcome(kind, False, time.perf_counter() - t0, error=what[:300])


async def send(client: httpx.AsyncClient, url: str, req: MixRequest, model: Optional[str], headers: dict,
               continuous: bool = True) -> Outcome:
    """One request of the mix; a stream is read until its cut (then the connection is dropped)."""
    body = req.with_model(model)
    if req.cut_after is not None or body.get("stream"):
        if not continuous:
            body["stream_options"] = {"include_usage": True}
        return await _stream(client, f"{url}{req.path}", req, body, headers)
    t0 = time.perf_counter()
    try:
        r = await client.post(f"{url}{req.path}", json=body, headers=headers)
    except httpx.HTTPError as e:
        return _error(req.kind, t0, f"{type(e).__name__}: {e}")
    if r.status_code != 200:
        return _error(req.kind, t0, f"HTTP {r.status_code}: {r.text[:200]}")
    out = r.json()
    choice = out["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"].get("content") or ""
    u = out.get("usage") or {}
    return Outcome(req.kind, True, time.perf_counter() - t0, u.get("prompt_tokens"), u.get("completion_tokens", 0),
                   text=text, finish_reason=choice.get("finish_reason"))


async def _stream(client: httpx.AsyncClient, url: str, req: MixRequest, body: dict, headers: dict) -> Outcome:
    t0 = time.perf_counter()
    times: list[float] = []
    text: list[str] = []
    prompt_tokens, generated, finish = None, 0, None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                return _error(req.kind, t0, f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    return _error(req.kind, t0, f"stream error: {str(chunk['error'].get('message'))[:200]}")
                u = chunk.get("usage")
                if u:
                    prompt_tokens, generated = u.get("prompt_tokens"), u.get("completion_tokens", generated)
                if chunk.get("choices"):
                    times.append(time.perf_counter())
                    c = chunk["choices"][0]
                    text.append(c.get("text") or "")
                    finish = c.get("finish_reason") or finish
                    if not u:  # no usage on the chunks: one chunk, one token (as the serving benchmarks count)
                        generated += 1
                if req.cut_after is not None and generated >= req.cut_after:
                    break  # the client hangs up: leaving the block drops the connection
    except httpx.HTTPError as e:
        return _error(req.kind, t0, f"{type(e).__name__}: {e}")
    if not times:
        return _error(req.kind, t0, "no tokens streamed")
    return Outcome(req.kind, True, time.perf_counter() - t0, prompt_tokens, generated, times[0] - t0,
                   [b - a for a, b in zip(times, times[1:])], "".join(text),
                   finish if req.cut_after is None else "cut")


def keeps_to_schema(text: str) -> bool:
    """The answer parses as JSON and keeps to ``SCHEMA``."""
    try:
        v = json.loads(text)
    except ValueError:
        return False
    if not isinstance(v, dict) or set(v) != {"name", "age", "tags"}:
        return False
    name, age, tags = v["name"], v["age"], v["tags"]
    return (isinstance(name, str) and len(name) <= 24 and isinstance(age, int) and not isinstance(age, bool)
            and 0 <= age <= 150 and isinstance(tags, list) and len(tags) <= 3
            and all(isinstance(t, str) and len(t) <= 12 for t in tags))


@dataclass
class Sent:
    request: MixRequest
    outcome: Outcome


async def run_mix(url: str, model: Optional[str], clients: int, duration_s: float, seed: int, scale: float,
                  headers: dict, continuous: bool) -> tuple[list[Sent], int, float]:
    """Every client's requests until the deadline: (what each sent and got, requests cut at the deadline, seconds)."""
    sent: list[Sent] = []
    cut_at_deadline = 0
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(max(600.0, duration_s)), limits=limits) as client:
        t0 = time.perf_counter()
        deadline = t0 + duration_s

        async def one_client(k: int) -> None:
            nonlocal cut_at_deadline
            rng = random.Random(f"{seed}:{k}")
            while time.perf_counter() < deadline:
                req = draw(rng, scale)
                task = asyncio.ensure_future(send(client, url, req, model, headers, continuous))
                done, _ = await asyncio.wait({task}, timeout=max(0.0, deadline - time.perf_counter()))
                if not done:
                    task.cancel()
                    cut_at_deadline += 1
                    try:
                        await task
                    except asyncio.CancelledError:
                        pass
                    return
                sent.append(Sent(req, task.result()))

        await asyncio.gather(*(one_client(k) for k in range(clients)))
        elapsed = time.perf_counter() - t0
    return sent, cut_at_deadline, elapsed


async def verify(url: str, model: Optional[str], sent: list[Sent], k: int, headers: dict,
                 continuous: bool) -> dict:
    """Send ``k`` finished greedy requests again, one at a time: did the load change their answers?"""
    chosen = [s for s in sent if s.outcome.ok and s.request.greedy and s.outcome.text is not None][:k]
    changed: list[dict] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        for s in chosen:
            alone = await send(client, url, s.request, model, headers, continuous)
            if not alone.ok:
                changed.append({"kind": s.request.kind, "error": alone.error})
                continue
            a, b = s.outcome.text or "", alone.text or ""
            if s.request.cut_after is not None:  # a cut stream: its text is a prefix of the answer alone
                n = min(len(a), len(b))
                a, b = a[:n], b[:n]
            if a != b:
                part = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                changed.append({"kind": s.request.kind, "parts_at_char": part, "under_load": a[part:part + 40],
                                "alone": b[part:part + 40]})
    return {"checked": len(chosen), "equal": len(chosen) - len(changed), "changed": changed[:10]}


def summarize(sent: list[Sent], cut_at_deadline: int, elapsed: float) -> dict:
    by_kind: dict[str, list[Outcome]] = defaultdict(list)
    for s in sent:
        by_kind[s.outcome.kind].append(s.outcome)
    kinds = {}
    for kind, outs in sorted(by_kind.items()):
        ok = [o for o in outs if o.ok]
        errors = Counter(o.error for o in outs if not o.ok)
        kinds[kind] = {
            "requests": len(ok), "errors": sum(errors.values()), "error_samples": [e for e, _ in errors.most_common(3)],
            "prompt_tokens": sum(o.prompt_tokens or 0 for o in ok),
            "prompt_tokens_unknown": sum(o.prompt_tokens is None for o in ok),
            "generated_tokens": sum(o.generated_tokens for o in ok),
            "e2e_ms": percentiles([o.e2e_s * 1e3 for o in ok]),
            **({"ttft_ms": percentiles([o.ttft_s * 1e3 for o in ok if o.ttft_s is not None]),
                "itl_ms": percentiles([x * 1e3 for o in ok for x in o.itl_s])} if kind == "stream" else {}),
        }
    ok = [s.outcome for s in sent if s.outcome.ok]
    json_done = [o for o in ok if o.kind == "json_chat" and o.finish_reason == "stop"]
    totals = {
        "requests": len(ok), "errors": sum(not s.outcome.ok for s in sent), "cut_at_deadline": cut_at_deadline,
        "prompt_tokens": sum(o.prompt_tokens or 0 for o in ok),
        "generated_tokens": sum(o.generated_tokens for o in ok),
        "elapsed_s": elapsed,
    }
    totals.update(requests_s=totals["requests"] / elapsed, prompt_tok_s=totals["prompt_tokens"] / elapsed,
                  generated_tok_s=totals["generated_tokens"] / elapsed)
    return {"totals": totals, "by_kind": kinds,
            "json_schema": {"finished": len(json_done), "kept_to_schema": sum(keeps_to_schema(o.text or "")
                                                                               for o in json_done)}}


def _supports_continuous_usage(url: str, model: Optional[str], headers: dict) -> bool:
    body = {"prompt": "Hello", "max_tokens": 1, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if model:
        body["model"] = model
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=120) as r:
        r.read()
        return r.status_code == 200


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="appliance bench mix")
    p.add_argument("--base-url", default=None, help="an OpenAI-compatible server; default: start appliance run")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--duration", type=float, default=240.0, help="seconds of load")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale", type=float, default=1.0, help="multiplies every prompt and output length")
    p.add_argument("--verify", type=int, default=16, metavar="K",
                   help="greedy requests sent again alone afterwards to see whether the load changed them")
    p.add_argument("--label", default=None, help="name of the server under test in the results")
    p.add_argument("--out", default="bench-results")
    a, overrides = split_overrides(p, argv)
    if a.clients < 1 or not a.duration > 0 or not a.scale > 0 or a.verify < 0:
        p.error("--clients, --duration and --scale must be positive and --verify not negative")
    url, own = server_under_test(a.base_url, overrides)
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    try:
        model = a.model or httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        continuous = _supports_continuous_usage(url, model, headers)
        sent, cut, elapsed = asyncio.run(run_mix(url, model, a.clients, a.duration, a.seed, a.scale, headers,
                                                 continuous))
        checked = asyncio.run(verify(url, model, sent, a.verify, headers, continuous)) if a.verify else None
    finally:
        if own:
            own.stop()
    label = a.label or ("appliance" if own else url)
    res = summarize(sent, cut, elapsed)
    path = write_results(a.out, result_name("mix", label) if a.label else "mix",
                         {"server": label, "model": model, "clients": a.clients, "duration_s": a.duration,
                          "seed": a.seed, "scale": a.scale, "continuous_usage": continuous, **res,
                          **({"verify": checked} if checked is not None else {})})
    t = res["totals"]
    png = plot_bars(a.out, path.stem, f"{label}: {a.clients} clients, {a.duration:g} s of the mix",
                    {"requests/s x10": 10 * t["requests_s"], "prompt tok/s / 10": t["prompt_tok_s"] / 10,
                     "generated tok/s": t["generated_tok_s"]}, "rate")
    print(f"{t['requests']} requests ({t['requests_s']:.2f}/s), {t['prompt_tokens']} prompt tokens "
          f"({t['prompt_tok_s']:.0f}/s), {t['generated_tokens']} generated ({t['generated_tok_s']:.1f}/s) in "
          f"{t['elapsed_s']:.0f} s; {t['errors']} errors, {t['cut_at_deadline']} cut at the deadline")
    for kind, k in res["by_kind"].items():
        extra = f", TTFT p50 {k['ttft_ms']['p50']:.0f} ms, ITL p99 {k['itl_ms']['p99']:.0f} ms" if "ttft_ms" in k else ""
        print(f"  {kind:<10} {k['requests']:>5} done, {k['errors']} errors, E2E p50 {k['e2e_ms']['p50']:.0f} ms "
              f"p99 {k['e2e_ms']['p99']:.0f} ms{extra}")
    js = res["json_schema"]
    print(f"JSON answers that finished: {js['finished']}, kept to the schema: {js['kept_to_schema']}")
    if checked is not None:
        print(f"answers sent again alone: {checked['equal']} of {checked['checked']} equal")
    print(f"wrote {path} and {png}")
    return 1 if t["errors"] else 0
