"""The GPU profile served over HTTP, for scripts/gpu_check.py's ``serve`` section.

The lent machine starts bare and SmolLM2's file (94 MB) cannot travel with the
check, so the model is a random Llama of 91M parameters (the tiny_random
generator at a larger shape: 8 layers of hidden 1024, GQA 4, head dim 64),
generated there once. Cases:

- ``parity``: the GPU server (``+profile=auto`` in fp32 on the profile's
  attention chain) against the same model served by the CPU profile in fp32:
  per prompt, the greedy steps until the paths part and the largest
  log-probability difference over them (a random model's logits are near ties,
  so paths part; the log-probabilities before that must agree; in bf16 they
  differ by up to half a nat at this depth, which would hide a real fault);
- ``structured``: a choice and a regex constraint on the GPU server, the
  answers in the set / matching;
- ``speculative``: the profile as shipped (fp8 weights and KV) with n-gram
  speculation served, against the offline ``LLM`` of that profile without it:
  greedy tokens identical, and drafts made (their acceptance from ``/metrics``);
- ``roofline``: the time per token of one request at batch 1 on the bf16 server
  (two lengths, the difference), as weight bytes per second against the plan's
  decode roofline;
- ``kv_plan``: the plan's KV cache, weights and activations for this device
  against the memory the device reports.
"""

from __future__ import annotations

import os
import re
import sys
import time
from typing import Callable, Iterator

import httpx
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["model=tiny_random", "model.hidden_size=1024", "model.num_layers=8", "model.num_heads=16",
         "model.num_kv_heads=4", "model.head_dim=64", "model.intermediate_size=2816", "model.param_count_b=0.091"]
GPU_BF16 = ["+profile=auto", *MODEL, "model.dtype=bfloat16", "quantization=none", "cache.kv_cache_dtype=auto",
            "attention.fallback=allow", "cache.num_blocks=4096"]
GPU_FP32 = ["+profile=auto", *MODEL, "model.dtype=float32", "quantization=none", "cache.kv_cache_dtype=auto",
            "attention.fallback=allow", "cache.num_blocks=4096"]
GPU_SHIPPED = ["+profile=auto", *MODEL, "attention.fallback=allow", "cache.num_blocks=4096"]
CPU_FP32 = ["+profile=cpu", *MODEL, "model.dtype=float32", "cache.num_blocks=1024"]
PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog.", "one two three one two three one two three"]
# n-gram drafting needs the context to repeat; a random model's greedy text seldom does within a few tokens, so
# the speculative case looks up single tokens (prompt_lookup_min=1) in a prompt that holds most of them
SPEC_PROMPTS = [" ".join(f"{w}{i}" for i in range(40) for w in ("a", "b")), *PROMPTS[1:]]
TOKENS = 24


class Servers:
    """The servers the cases share, started on first use and stopped at the end."""

    def __init__(self):
        self._up: dict[str, object] = {}

    def get(self, name: str, overrides: list[str]):
        if name not in self._up:
            sys.path.insert(0, ROOT)
            from appliance.server.local import LocalServer

            log = os.path.join(os.environ.get("OUT") or "gpu-results", f"server-{name}.log")
            self._up[name] = LocalServer(overrides, timeout_s=300, log_path=log, cwd=ROOT)
        return self._up[name]

    def close(self) -> None:
        for server in self._up.values():
            server.stop()
        self._up.clear()


def served_model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def complete(url: str, prompt: str, **kw) -> dict:
    body = {"model": served_model(url), "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "logprobs": 1, **kw}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]


def parity(servers: Servers) -> dict:
    gpu, cpu = servers.get("gpu-fp32", GPU_FP32), servers.get("cpu-fp32", CPU_FP32)
    agreed, worst = [], 0.0
    for prompt in PROMPTS:
        a, b = complete(cpu.url, prompt)["logprobs"], complete(gpu.url, prompt)["logprobs"]
        steps = 0
        for ta, tb, la, lb in zip(a["tokens"], b["tokens"], a["token_logprobs"], b["token_logprobs"]):
            if ta != tb:
                break
            worst = max(worst, abs(la - lb))
            steps += 1
        agreed.append(steps)
    return {"steps_agreed": agreed, "of": TOKENS, "max_abs_logprob_diff_until_divergence": worst,
            "ok": worst < 0.1 and sum(agreed) > 0}


def structured(servers: Servers) -> dict:
    url = servers.get("gpu-bf16", GPU_BF16).url
    choices = ["alpha", "beta", "gamma"]
    picked = complete(url, "Pick one:", guided_choice=choices, max_tokens=16)["text"]
    digits = complete(url, "Three digits:", guided_regex="[0-9]{3}", max_tokens=16)["text"]
    return {"choice": picked, "regex": digits,
            "ok": picked in choices and re.fullmatch("[0-9]{3}", digits) is not None}


def speculative(servers: Servers) -> dict:
    sys.path.insert(0, ROOT)
    from appliance import LLM, SamplingParams

    spec = servers.get("gpu-ngram", [*GPU_SHIPPED, "speculative=ngram", "speculative.prompt_lookup_min=1"])
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    plain = [o.outputs[0].text for o in LLM(overrides=GPU_SHIPPED).generate(SPEC_PROMPTS, params, use_tqdm=False)]
    served = [complete(spec.url, p, ignore_eos=True, logprobs=None)["text"] for p in SPEC_PROMPTS]
    drafted = accepted = 0.0
    deadline = time.time() + 20  # the engine's counters reach /metrics at its next stats report
    while drafted == 0 and time.time() < deadline:
        time.sleep(1)
        metrics = httpx.get(f"{spec.url}/metrics", timeout=30).text
        drafted, accepted = (metric(metrics, f"appliance:spec_decode_num_{n}_tokens_total") for n in ("draft", "accepted"))
    return {"identical": sum(a == b for a, b in zip(plain, served)), "prompts": len(SPEC_PROMPTS),
            "draft_tokens": drafted, "accepted_tokens": accepted, "ok": plain == served and drafted > 0}


def metric(text: str, name: str) -> float:
    """A Prometheus series' value summed over its labels."""
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name + "{"))


def roofline(servers: Servers) -> dict:
    sys.path.insert(0, ROOT)
    from appliance.config.compose import resolve
    from appliance.config.plan import make_plan

    url = servers.get("gpu-bf16", GPU_BF16).url
    plan = make_plan(resolve(GPU_BF16).cfg)
    # the time per generated token: two requests that differ only in length, each the best of three
    def seconds(tokens: int) -> float:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            done = complete(url, "Hello", max_tokens=tokens, ignore_eos=True, logprobs=None)
            best = min(best, time.perf_counter() - t0)
        assert done["finish_reason"] == "length"
        return best

    short, long = seconds(8), seconds(136)
    itl = (long - short) / 128
    bytes_per_s = plan.weight_bytes_per_device / itl
    return {"itl_ms": itl * 1e3, "tok_s": 1 / itl, "weight_bytes": plan.weight_bytes_per_device,
            "achieved_GBps": bytes_per_s / 1e9, "roofline_tok_s": plan.decode_roofline_tok_s,
            "share_of_roofline": (1 / itl) / plan.decode_roofline_tok_s, "ok": itl > 0}


def kv_plan() -> dict:
    sys.path.insert(0, ROOT)
    from appliance.config.compose import resolve
    from appliance.config.plan import make_plan

    cfg = resolve([o for o in GPU_SHIPPED if not o.startswith("cache.num_blocks")]).cfg
    plan = make_plan(cfg)
    free, total = torch.cuda.mem_get_info()
    planned = plan.weight_bytes_per_device + plan.activation_bytes_per_device + plan.kv_cache_bytes
    usable = total * cfg.cache.memory_utilization
    return {"num_kv_blocks": plan.num_kv_blocks, "planned_GiB": planned / 2**30,
            "device_total_GiB": total / 2**30, "device_free_GiB": free / 2**30,
            "hardware_memory_gib": cfg.hardware.memory_gib, "usable_GiB": usable / 2**30, "ok": planned <= usable}


def serve_cases(servers: Servers) -> Iterator[tuple[dict, Callable[[], dict]]]:
    """The cases (``GPU_SERVE_CASES=kv_plan,parity,...`` picks some; all by default)."""
    cases = [({"case": "kv_plan"}, kv_plan),
             ({"case": "parity", "vs": "cpu profile, fp32"}, lambda: parity(servers)),
             ({"case": "structured"}, lambda: structured(servers)),
             ({"case": "roofline", "batch": 1}, lambda: roofline(servers)),
             ({"case": "speculative", "method": "ngram"}, lambda: speculative(servers))]
    wanted = os.environ.get("GPU_SERVE_CASES")
    for what, fn in cases:
        if not wanted or what["case"] in wanted.split(","):
            yield what, fn
