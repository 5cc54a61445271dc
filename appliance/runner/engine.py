"""The engine core a deployment runs: its step runner (``ranks``), KV cache,
scheduler with its KV connector's side (``kv``), token budget, output
constraints and KV events."""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional

from appliance.config.architectures import chat_format
from appliance.config.deployment import Deployment
from appliance.config.kv_connectors import connector_of
from appliance.runner.kv import connector_sides, kv_event_publisher, kv_group_specs
from appliance.runner.ranks import place_data_parallel_rank, step_runner

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from appliance.engine.core import EngineCore
    from appliance.engine.scheduler import Scheduler
    from appliance.engine.token_budget import TokenBudget


def build_engine(deployment: Deployment) -> tuple[EngineCore, PreTrainedTokenizerBase]:
    """Model, backend, KV cache, scheduler and engine core for ``deployment``:
    the model runner in this process (executor ``uni``), or an executor over
    a worker process per tensor-parallel rank (``mp``, ``worker.executor``)
    or a Ray actor per rank (``ray``, ``worker.ray_executor``), each building
    its part with ``build_rank_runner``. A data-parallel
    rank's core first takes its share of the host (``place_data_parallel_rank``).

    Returns (EngineCore, tokenizer)."""
    from appliance.engine.core import EngineCore

    cfg = deployment.cfg
    place_data_parallel_rank(deployment)
    row = connector_of(cfg)
    if row is not None and row.disaggregated and deployment.kv_engine_id is None:  # one for its ranks
        deployment = replace(deployment, kv_engine_id=uuid.uuid4().hex)
    runner, tokenizer, lockstep = step_runner(deployment)
    scheduler_side, worker_side = connector_sides(deployment, runner) or (None, None)
    if worker_side is not None:
        runner.kv_connector = worker_side
    eos = tokenizer.eos_token_id
    return EngineCore(_scheduler(deployment, scheduler_side), runner, tokenizer, eos,
                      vocab_size=cfg.model.vocab_size, token_budget=_token_budget(deployment),
                      grammars=_grammars(cfg, tokenizer, eos), lockstep=lockstep,
                      kv_events=kv_event_publisher(deployment)), tokenizer


def _scheduler(deployment: Deployment, connector: Any) -> Scheduler:
    """The scheduler over a KV cache of the plan's blocks, at the plan's token
    budget, with the KV connector's scheduler side (``connector``; None: none)."""
    from appliance.engine.kv_cache.manager import KVCacheManager
    from appliance.engine.scheduler import Scheduler

    cfg = deployment.cfg
    kv = KVCacheManager(deployment.num_kv_blocks, cfg.cache.block_size, cfg.cache.enable_prefix_caching,
                        cfg.cache.prefix_caching_hash_algo, enable_events=cfg.kv_events.enabled,
                        groups=kv_group_specs(deployment))
    s = cfg.scheduler
    return Scheduler(
        kv,
        max_num_batched_tokens=deployment.plan.token_budget,
        max_num_seqs=s.max_num_seqs,
        max_model_len=deployment.max_model_len,
        policy=s.policy,
        enable_chunked_prefill=s.enable_chunked_prefill,
        long_prefill_token_threshold=s.long_prefill_token_threshold,
        max_num_partial_prefills=s.max_num_partial_prefills,
        max_long_partial_prefills=s.max_long_partial_prefills,
        # a draft model writes its K/V at the positions of its drafts, past the step
        num_lookahead_tokens=cfg.speculative.num_speculative_tokens if cfg.speculative.method == "draft_model" else 0,
        connector=connector,
        long_rope_from=rs.original_max_position_embeddings if (rs := cfg.model.rope_scaling).type == "longrope" else None,
    )


def _token_budget(deployment: Deployment) -> Optional[TokenBudget]:
    """The step token budget that follows ``scheduler.target_itl_ms`` and
    ``scheduler.max_itl_ratio`` from the plan's first estimate (None, with
    neither: the plan's fixed budget)."""
    from appliance.engine.token_budget import TokenBudget

    s = deployment.cfg.scheduler
    if s.target_itl_ms is None and s.max_itl_ratio is None:
        return None
    return TokenBudget(s.target_itl_ms, deployment.plan.token_budget, s.max_num_batched_tokens,
                       min_prefill_share=s.min_prefill_share, max_itl_ratio=s.max_itl_ratio)


def _grammars(cfg: Any, tokenizer: Any, eos: Optional[int]):
    """The output constraints' compiler (``structured_output``) for this tokenizer;
    a grammar ends on the model's end-of-sequence token. With a reasoning parser,
    or a harmony model's channels, constraints apply to the answer only."""
    from appliance.server.harmony import ANSWER_START, REASONING_START
    from appliance.server.reasoning import REASONING_PARSERS
    from appliance.structured_output import ConstraintLimits, Grammars, ReasoningTags

    so = cfg.structured_output
    tags: Optional[tuple[str, str]] = None
    if cfg.server.reasoning_parser is not None:  # after the reasoning's end tag
        parser = REASONING_PARSERS[str(cfg.server.reasoning_parser)]
        tags = parser.start, parser.end
    elif chat_format(cfg.model.architecture) == "harmony":  # on the final channel
        tags = REASONING_START, ANSWER_START
    reasoning = None if tags is None else ReasoningTags(
        *(tuple(tokenizer.encode(t, add_special_tokens=False)) for t in tags))
    return Grammars(tokenizer, cfg.model.vocab_size, [] if eos is None else [eos], so.num_threads,
                    so.cache_size_mib << 20, any_whitespace=not so.disable_any_whitespace,
                    max_whitespace=so.max_json_whitespace,
                    limits=ConstraintLimits(so.max_schema_bytes, so.max_schema_depth), reasoning=reasoning)
