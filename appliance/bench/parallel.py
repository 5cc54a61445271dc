"""`appliance bench parallel`: the parallel layouts side by side on this
machine, in one run, and where a step's time goes.

Offline (``LLM.generate``, greedy, ``--num-prompts`` prompts of
``--input-len`` random tokens, ``--output-len`` tokens each, all submitted
together): one rank on its default path (the whole-step native forward on
CPUs), one rank on the torch layer-by-layer path (``attention.backend=
torch_sdpa``: the path a pipeline stage runs; a tensor-parallel rank of a
dense model runs the native forward), then each
of ``--layouts`` (e.g. ``tp3``, ``pp2``, ``tp3 with gloo``; ``pp2`` also
with one step in flight, the stages taking turns, against its default of
one step per stage in flight so that they overlap). Served (the
offline ``LLM`` runs one engine core): one core against ``dp2``, the same
prompts sent at once to ``appliance run``.

Collectives: the latency of one all-reduce of a decode step's hidden row
(``hidden_size`` elements of the model dtype) between ``world`` ranks of
this host, over the shared-memory segment and over gloo. For each layout
the plan's collectives per forward times that latency is the time a step
spends in collectives (``comm_ms_per_step``, an estimate from measured
parts); the rest of the measured step is compute and Python.

Results: output tok/s, steps, ms per step, the ratio to one rank, and the
host's CPU model and flags, as JSON plus a bar plot.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import time
from typing import Any

from appliance.bench.common import counting_steps, plot_bars, random_prompts, split_overrides, write_results

# label -> extra overrides; "served" layouts run behind appliance run
OFFLINE = {
    "1 rank (native forward)": [],
    "1 rank (torch layer path)": ["attention.backend=torch_sdpa"],
}
LAYOUTS = {
    "tp3 (shm)": ["parallel=tp3"],
    "tp3 (gloo)": ["parallel=tp3", "parallel.cpu_collectives=gloo"],
    "pp2 (shm)": ["parallel=pp2"],
    "pp2 (shm; 1 step in flight)": ["parallel=pp2"],
}
ONE_STEP_IN_FLIGHT = {"pp2 (shm; 1 step in flight)"}  # the engine core waits for each step before the next
SERVED = {"1 core (served)": [], "dp2 (served)": ["parallel=dp2"]}


def _latency_rank(kind: str, rank: int, world: int, nbytes: int, iters: int, where: str, port: int, q: Any) -> None:
    import torch

    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= world:
        os.sched_setaffinity(0, [cores[rank]])
    t = torch.ones(nbytes // 4)
    if kind == "shm":
        from appliance.kernels.shm_comm import ShmComm

        comm: Any = ShmComm(where, rank, world, 60)
        reduce = comm.all_reduce
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        reduce = dist.all_reduce
    for _ in range(max(10, iters // 10)):
        reduce(t)
    t0 = time.perf_counter()
    for _ in range(iters):
        reduce(t)
    seconds = (time.perf_counter() - t0) / iters
    if kind == "gloo":
        dist.destroy_process_group()
    if rank == 0:
        q.put(seconds)


def collective_latency_us(kind: str, world: int, nbytes: int, iters: int) -> float:
    """Microseconds per all-reduce of ``nbytes`` between ``world`` ranks of this host."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    where = ""
    if kind == "shm":
        from appliance.kernels.shm_comm import create_segment

        where = create_segment(world)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_latency_rank, args=(kind, r, world, nbytes, iters, where, port, q))
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        return q.get(timeout=300) * 1e6
    finally:
        for p in procs:
            p.join(30)
        if where:
            os.unlink(where)


def offline(overrides: list[str], prompts: list[list[int]], output_len: int, one_step: bool = False) -> dict:
    from appliance import LLM, SamplingParams

    llm = LLM(overrides=overrides)
    if one_step:
        llm.engine.max_in_flight = 1
    try:
        llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm-up
        with counting_steps(llm.engine) as counter:
            t = time.perf_counter()
            outs = llm.generate(prompts, SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True),
                                use_tqdm=False)
            elapsed = time.perf_counter() - t
        plan, layout = llm.deployment.plan, llm.deployment.layout
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return {"output_tok_s": tokens / elapsed, "elapsed_s": elapsed, "steps": counter["steps"],
                "ms_per_step": 1e3 * elapsed / counter["steps"], "executor": layout.executor,
                "ranks": layout.ranks_per_engine, "collectives_per_step": plan.collectives_per_step,
                "collectives": getattr(llm.engine.runner, "collectives", None)}  # an executor's: shm or gloo
    finally:
        getattr(llm.engine.runner, "close", lambda: None)()


def served(overrides: list[str], prompts: list[list[int]], output_len: int) -> dict:
    from appliance.bench.serve import run_level
    from appliance.server.local import LocalServer

    server = LocalServer(overrides, ready_path="/ready")
    try:
        asyncio.run(run_level(server.url, None, prompts[:1], 2, 1, float("inf"), {}, 0))  # warm-up
        level = asyncio.run(run_level(server.url, None, prompts, output_len, len(prompts), float("inf"), {}, 0))
    finally:
        server.stop()
    ok = [r for r in level["results"] if r["ok"]]
    tokens = sum(r["output_tokens"] for r in ok)
    return {"output_tok_s": tokens / level["elapsed_s"], "elapsed_s": level["elapsed_s"], "ok": len(ok),
            "requests": len(prompts)}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="appliance bench parallel")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of: {', '.join(LAYOUTS)}")
    p.add_argument("--no-served", action="store_true", help="skip the served one core vs dp2 comparison")
    p.add_argument("--iters", type=int, default=2000, help="all-reduces timed per latency figure")
    p.add_argument("--out", default="bench-results")
    a, overrides = split_overrides(p, argv)
    layouts = [x.strip() for x in a.layouts.split(",") if x.strip()]
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown:
        p.error(f"unknown layouts {unknown}; choose from {list(LAYOUTS)}")
    from appliance.config.compose import resolve
    from appliance.config.execution import resolve_execution

    base = ["+profile=cpu", *overrides]
    cfg = resolve(base).cfg
    m = cfg.model
    prompts = random_prompts(a.num_prompts, [a.input_len] * a.num_prompts, m.vocab_size)
    runs: dict[str, dict] = {}
    for label, extra in [*OFFLINE.items(), *((k, LAYOUTS[k]) for k in layouts)]:
        runs[label] = offline([*base, *extra], prompts, a.output_len, label in ONE_STEP_IN_FLIGHT)
        print(f"{label:28s} {runs[label]['output_tok_s']:7.1f} tok/s  {runs[label]['ms_per_step']:7.1f} ms/step",
              flush=True)
    if not a.no_served:
        for label, extra in SERVED.items():
            runs[label] = served([*base, *extra], prompts, a.output_len)
            print(f"{label:28s} {runs[label]['output_tok_s']:7.1f} tok/s", flush=True)
    row_bytes = m.hidden_size * (4 if resolve_execution(cfg).dtype == "float32" else 2)
    latency = {}
    for world in sorted({r["ranks"] for r in runs.values() if r.get("ranks", 1) > 1}):
        for kind in ("shm", "gloo"):
            iters = a.iters if kind == "shm" else max(50, a.iters // 20)
            latency[f"{kind}/{world}"] = collective_latency_us(kind, world, row_bytes, iters)
            print(f"all-reduce of {row_bytes} B, {world} ranks, {kind}: {latency[f'{kind}/{world}']:.1f} us",
                  flush=True)
    if "pp2 (shm)" in runs and "pp2 (shm; 1 step in flight)" in runs:
        runs["pp2 (shm)"]["vs_one_step_in_flight"] = (runs["pp2 (shm)"]["output_tok_s"]
                                                      / runs["pp2 (shm; 1 step in flight)"]["output_tok_s"])
    torch_path = runs["1 rank (torch layer path)"]
    for r in runs.values():
        if r.get("ranks", 1) > 1 and r.get("collectives"):
            comm_ms = r["collectives_per_step"] * latency[f"{r['collectives']}/{r['ranks']}"] / 1e3
            r["comm_ms_per_step"] = comm_ms  # estimate: calls x measured latency
            r["rest_ms_per_step"] = r["ms_per_step"] - comm_ms
            r["vs_torch_layer_path"] = r["output_tok_s"] / torch_path["output_tok_s"]
        r["vs_one_rank"] = r["output_tok_s"] / runs["1 rank (native forward)"]["output_tok_s"]
    if "1 core (served)" in runs:
        runs["dp2 (served)"]["vs_one_core_served"] = (runs["dp2 (served)"]["output_tok_s"]
                                                      / runs["1 core (served)"]["output_tok_s"])
    path = write_results(a.out, "parallel", {"overrides": base, "num_prompts": a.num_prompts,
                                             "input_len": a.input_len, "output_len": a.output_len,
                                             "hidden_row_bytes": row_bytes, "all_reduce_latency_us": latency,
                                             "runs": runs})
    plot_bars(a.out, "parallel", "parallel layouts on this machine", {k: v["output_tok_s"] for k, v in runs.items()},
              "output tok/s")
    print(path)
    return 0
