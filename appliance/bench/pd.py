"""`appliance bench pd`: disaggregated prefill (``kv_transfer=p2p``, and / or
``nixl`` with ``--connectors``) on a long prompt, a colocated engine and a
producer and a consumer per connector in this process over loopback.

For each of ``--repeat`` fresh ``--prompt-len``-token prompts:

- colocated: one engine's time to first token, prefill included;
- producer: the prefill alone, held for a consumer
  (``do_remote_decode``);
- consumer: the time to first token of an engine given the producer's
  ``kv_transfer_params``. It fetches every block but the one the last token
  fills, writes them, runs the last token, and samples.

Reported: medians, the bytes fetched and the rate each consumer got them
at (its time to first token less a one-token step, measured on its own),
and each consumer's time against the colocated prefill (and nixl's against
p2p's when both run). Every consumer's first token is the colocated
engine's; that is checked, not assumed.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import time
from typing import TYPE_CHECKING

from appliance.bench.common import plot_bars, random_prompts, split_overrides, write_results
from appliance.config.kv_connectors import KV_CONNECTORS

if TYPE_CHECKING:
    from appliance.entrypoint import RequestOutput


def _timed(llm, prompt: list[int], params) -> tuple[float, RequestOutput]:
    t = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    return (time.perf_counter() - t) * 1e3, out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="appliance bench pd")
    p.add_argument("--prompt-len", type=int, default=4000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--connectors", default="p2p",
                   help="comma-separated: p2p (the blocks in ZeroMQ messages), nixl (read through NIXL)")
    p.add_argument("--out", default="bench-results")
    a, overrides = split_overrides(p, argv)
    connectors = [c for c in a.connectors.split(",") if c]
    built = [c.name for c in KV_CONNECTORS.values() if c.disaggregated]
    if not connectors or any(c not in built for c in connectors):
        p.error(f"--connectors {a.connectors!r}: {' and / or '.join(built)}")
    from appliance import LLM, SamplingParams
    from appliance.server.auth import INTERNAL_KEY_ENV
    from appliance.server.local import free_port_run

    # the pairs in this process sign their messages with a key of their own unless the deployment names one
    os.environ.setdefault(INTERNAL_KEY_ENV, secrets.token_hex(32))
    plain = LLM(overrides=overrides)
    ranks = plain.deployment.layout.ranks_per_engine  # a producer's rank r listens on the port + r
    pairs = {c: (LLM(overrides=[*overrides, f"kv_transfer={c}", "kv_transfer.role=producer",
                                f"kv_transfer.p2p.port={free_port_run(ranks)}"]),
                 LLM(overrides=[*overrides, f"kv_transfer={c}", "kv_transfer.role=consumer"])) for c in connectors}
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prefill = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True,
                             kv_transfer_params={"do_remote_decode": True})
    vocab = plain.resolved.cfg.model.vocab_size
    prompts = random_prompts(a.repeat + 1, [a.prompt_len] * (a.repeat + 1), vocab, seed=5)
    one_token = [_timed(plain, [7], first)[0] for _ in range(3)]  # a one-token step, warm
    runs: dict[str, list[float]] = {"colocated": []}
    fetched = 0
    for i, prompt in enumerate(prompts):
        ms_plain, out_plain = _timed(plain, prompt, first)
        if i > 0:  # the first round warms every engine up
            runs["colocated"].append(ms_plain)
        for c, (producer, consumer) in pairs.items():
            ms_prod, out_prod = _timed(producer, prompt, prefill)
            loaded = consumer.engine.scheduler.connector.loaded_tokens
            ms_cons, out_cons = _timed(consumer, prompt, SamplingParams(
                max_tokens=1, temperature=0, ignore_eos=True, kv_transfer_params=out_prod.kv_transfer_params))
            if out_cons.outputs[0].token_ids != out_plain.outputs[0].token_ids:
                raise RuntimeError(f"the {c} consumer's first token differs from the colocated engine's")
            if consumer.engine.scheduler.connector.failed_loads:
                raise RuntimeError(f"a {c} fetch failed; see the log")
            if i == 0:
                continue
            fetched = consumer.engine.scheduler.connector.loaded_tokens - loaded
            for name, ms in ((_name(c, "producer", connectors), ms_prod), (_name(c, "consumer", connectors), ms_cons)):
                runs.setdefault(name, []).append(ms)
    caches = plain.engine.runner.kv_caches
    bytes_per_token = sum(c[:, 0].numel() * c.element_size() for c in caches) // caches[0].shape[2]
    med = {name: statistics.median(v) for name, v in runs.items()}
    step_ms = statistics.median(one_token)
    consumers = {c: med[_name(c, "consumer", connectors)] for c in connectors}
    results = {
        "prompt_len": a.prompt_len, "repeat": a.repeat, "connectors": connectors, "runs_ms": runs, "median_ms": med,
        "one_token_step_ms": step_ms, "fetched_tokens": fetched, "fetched_bytes": fetched * bytes_per_token,
        "fetch_gb_s": {c: fetched * bytes_per_token / max(ms - step_ms, 1e-3) / 1e6 for c, ms in consumers.items()},
        "consumer_vs_colocated": {c: ms / med["colocated"] for c, ms in consumers.items()},
    }
    if len(connectors) == 2:
        results["consumer_nixl_vs_p2p"] = consumers["nixl"] / consumers["p2p"]
    path = write_results(a.out, "pd", results)
    plot_bars(a.out, "pd", f"{a.prompt_len}-token prompt: time to first token (ms)", med, "ms")
    for name, ms in med.items():
        print(f"{name:16s} {ms:9.1f} ms")
    print(f"fetched {fetched} tokens, {results['fetched_bytes'] / 1e6:.1f} MB")
    for c in connectors:
        print(f"{c}: at {results['fetch_gb_s'][c]:.2f} GB/s; consumer TTFT "
              f"{results['consumer_vs_colocated'][c]:.3f}x the colocated one")
    print(path)
    return 0


def _name(connector: str, role: str, connectors: list[str]) -> str:
    """A run's name: the role, with its connector when several are compared."""
    return role if len(connectors) == 1 else f"{connector} {role}"
