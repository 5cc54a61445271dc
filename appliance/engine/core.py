"""The engine core: scheduler + model runner + detokenization, one step at a time.

    step():  schedule() -> {req_id: n_tokens}
             runner.execute(sched_out) -> sampled tokens
             detokenize, find stop strings
             scheduler.update_from_output(...) -> finished requests freed

The same object runs inside the offline ``LLM`` and inside the server's
engine-core process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from appliance.engine.detokenizer import IncrementalDetokenizer
from appliance.engine.request import Request
from appliance.engine.scheduler import Scheduler
from appliance.sampling_params import SamplingParams


@dataclass
class RequestOutputDelta:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: Optional[str] = None
    stop_reason: Any = None
    logprobs: list = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    queue_time: Optional[float] = None  # on the first delta with tokens: seconds waiting before first scheduled


@dataclass
class StepStats:
    """Gauges and counters of the core after a step (sent to the front end)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    iteration_tokens: int = 0  # tokens scheduled by the last step (0: no step ran)


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: Any, tokenizer: Any, eos_token_id: Optional[int]):
        self.scheduler = scheduler
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.detok: dict[str, IncrementalDetokenizer] = {}
        self.last_stats = StepStats()

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: Optional[str] = None,
        arrival_time: Optional[float] = None,
    ) -> None:
        req = Request(request_id, prompt_token_ids, params, eos_token_id=self.eos_token_id,
                      arrival_time=arrival_time, priority=priority, cache_salt=cache_salt)
        self.scheduler.add_request(req)
        self.detok[request_id] = IncrementalDetokenizer(
            self.tokenizer, prompt_token_ids, params.stop, params.include_stop_str_in_output, params.skip_special_tokens
        )

    def abort(self, request_ids: list[str]) -> None:
        for req in self.scheduler.abort(request_ids):
            self.detok.pop(req.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self, iteration_tokens: int = 0) -> StepStats:
        s, kv = self.scheduler, self.scheduler.kv
        return StepStats(len(s.running), len(s.waiting), kv.usage(), s.num_preemptions, kv.stats.queries,
                         kv.stats.hits, iteration_tokens)

    def step(self) -> list[RequestOutputDelta]:
        sched_out = self.scheduler.schedule()
        runner_out = self.runner.execute(sched_out)
        stopped: dict[str, int] = {}
        for rid, toks in runner_out.sampled_token_ids.items():
            if self.detok[rid].add_tokens(toks) is not None:
                stopped[rid] = len(toks)
        updates = self.scheduler.update_from_output(sched_out, runner_out.sampled_token_ids, stopped)
        deltas = []
        for u in updates:
            req = u.request
            d = self.detok[req.request_id]
            if u.finished:
                if req.request_id not in stopped:
                    d.flush()
                del self.detok[req.request_id]
            deltas.append(RequestOutputDelta(
                request_id=req.request_id,
                new_token_ids=u.new_token_ids,
                new_text=d.take_delta(u.finished),
                finished=u.finished,
                finish_reason=req.finish_reason if u.finished else None,
                stop_reason=req.stop_reason if u.finished else None,
                logprobs=runner_out.logprobs.get(req.request_id, [])[: len(u.new_token_ids)],
                num_prompt_tokens=req.num_prompt_tokens,
                num_output_tokens=req.num_output_tokens,
                num_cached_tokens=max(0, req.num_cached_tokens),
                queue_time=(req.first_scheduled_time - req.arrival_time)
                if u.new_token_ids and req.num_output_tokens == len(u.new_token_ids) and req.first_scheduled_time
                else None,
            ))
        self.last_stats = self.stats(sched_out.total_num_scheduled_tokens)
        return deltas


# gguf checkpoints are dequantized into the compute dtype at load.
RUNNABLE_QUANTIZATION = ("none", "gguf", "int8_wo")


def build_engine(resolved: Any, selection: Any = None) -> tuple[EngineCore, Any]:
    """Compose model, backend, KV cache and scheduler for a resolved config.

    Returns (engine core, tokenizer).
    """
    import torch

    from appliance.config.plan import make_plan, max_model_len, resolve_dtype
    from appliance.engine.kv_cache.manager import KVCacheManager
    from appliance.kernels.registry import load_backend
    from appliance.models.loader import load_model
    from appliance.runner import check_runnable
    from appliance.worker.model_runner import ModelRunner

    cfg = resolved.cfg
    method = getattr(cfg.quantization.method, "value", cfg.quantization.method)
    if method not in RUNNABLE_QUANTIZATION:
        from appliance.errors import ConfigError

        raise ConfigError(
            f"quantization={method} can be planned but its weight kernels are not built yet; "
            f"serve with quantization=none (GGUF checkpoints are dequantized at load)"
        )
    sel = selection or check_runnable(resolved)
    dtype_name = resolve_dtype(cfg)
    dtype = getattr(torch, dtype_name)
    device = torch.device("cuda" if getattr(cfg.hardware.device_kind, "value", cfg.hardware.device_kind) in ("cuda", "rocm") else "cpu")
    m = cfg.model
    backend_cls = load_backend(sel.chosen)
    backend = backend_cls(m.num_heads, m.num_kv_heads, m.head_dim, m.head_dim ** -0.5,
                          getattr(cfg.cache.kv_cache_dtype, "value", cfg.cache.kv_cache_dtype))
    model, tokenizer, _ = load_model(m, backend, dtype, device)
    if method == "int8_wo":
        from appliance.models.quant import quantize_int8_weight_only

        quantize_int8_weight_only(model)
    plan = make_plan(cfg)
    num_blocks = cfg.cache.num_blocks or plan.num_kv_blocks
    mml = max_model_len(cfg)
    kv = KVCacheManager(num_blocks, cfg.cache.block_size, cfg.cache.enable_prefix_caching,
                        getattr(cfg.cache.prefix_caching_hash_algo, "value", cfg.cache.prefix_caching_hash_algo))
    s = cfg.scheduler
    scheduler = Scheduler(
        kv,
        max_num_batched_tokens=s.max_num_batched_tokens,
        max_num_seqs=s.max_num_seqs,
        max_model_len=mml,
        policy=getattr(s.policy, "value", s.policy),
        enable_chunked_prefill=s.enable_chunked_prefill,
        long_prefill_token_threshold=s.long_prefill_token_threshold,
        max_num_partial_prefills=s.max_num_partial_prefills,
        max_long_partial_prefills=s.max_long_partial_prefills,
    )
    eos = tokenizer.eos_token_id
    kv_dtype = backend.cache_dtype(backend.kv_cache_dtype, dtype)
    runner = ModelRunner(model, backend, num_blocks, cfg.cache.block_size, mml, s.max_num_seqs, dtype,
                         kv_dtype, device, eos, seed=m.seed)
    return EngineCore(scheduler, runner, tokenizer, eos), tokenizer



