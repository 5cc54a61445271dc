"""What a ``schedule()`` hands the model runner (``SchedulerOutput``: the
requests new to it, the running ones' new blocks, each one's token count,
drafts to verify, what ended or was preempted since, and the step's
structured-output masks and KV connector instructions) and what a step did
to each request (``RequestUpdate``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from appliance.engine.request import Request
    from appliance.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (or dropped at preemption)."""

    req_id: str
    token_ids: list[int]  # prompt + outputs so far (a resumed request recomputes them all)
    num_prompt_tokens: int
    block_ids: tuple[list[int], ...]  # per KV-cache group
    num_computed_tokens: int
    sampling_params: SamplingParams
    resumed: bool = False
    # the last of the computed tokens whose KV a KV connector supplied: the target's, not a draft model's
    num_external_tokens: int = 0


@dataclass
class CachedRequestData:
    req_id: str
    new_block_ids: tuple[list[int], ...]  # per KV-cache group
    num_computed_tokens: int
    # for ranks that do not sample (``Scheduler.send_token_ids``): the request's tokens sent to none yet,
    # up to the last of this step's (drafts apart); None: every rank has them
    new_token_ids: Optional[list[int]] = None


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
    grammar_bitmask: Any = None  # the structured-output masks of the step (``structured_output.StepBitmask``)
    kv_connector_metadata: Any = None  # the KV connector's instructions for the worker side (``engine/kv_connector.py``)
    # (src, dst) blocks whose KV the worker copies before the step's layers run: beams' forks, copy on write
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class RequestUpdate:
    """What one step did to one request, for the caller to stream out."""

    request: Request
    new_token_ids: list[int]
    finished: bool
