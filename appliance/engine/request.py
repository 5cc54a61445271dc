"""Per-request state the scheduler and KV cache manager work on (torch-free)."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any, Optional

from appliance.sampling_params import SamplingParams

if TYPE_CHECKING:  # the protocol sits with the engine's others; the core imports this module
    from appliance.engine.interfaces import RequestGrammar


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_GRAMMAR = 1  # queued, but its output constraint is still compiling
    WAITING_FOR_REMOTE_KVS = 2  # queued, holding blocks a KV connector is filling (engine/kv_p2p.py)
    RUNNING = 3
    PREEMPTED = 4
    # Everything after PREEMPTED is finished.
    FINISHED_STOPPED = 5
    FINISHED_LENGTH = 6
    FINISHED_ABORTED = 7

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: "RequestStatus") -> Optional[str]:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(status)


class Request:
    """One sequence: prompt, outputs so far, and how much KV is computed.

    ``num_computed_tokens`` counts tokens whose KV is in the cache (or is
    being written by the step just scheduled: the scheduler advances it at
    scheduling time, as vLLM V1 does). ``spec_token_ids`` are draft tokens
    scheduled for verification; ``num_tokens_with_spec`` includes them.
    A request whose grammar is compiling waits in WAITING_FOR_GRAMMAR: it
    keeps its place in the queue and the scheduler passes it over.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: Optional[SamplingParams] = None,
        eos_token_id: Optional[int] = None,
        arrival_time: Optional[float] = None,
        priority: int = 0,
        cache_salt: Optional[str] = None,
        lora_id: Optional[int] = None,
        mm_hashes: Optional[list[tuple[int, int, str]]] = None,
        grammar: Optional[RequestGrammar] = None,
    ):
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params or SamplingParams()
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        # a LongRoPE model's sequence past its original context (set by the scheduler): every position takes the
        # long frequencies, so its blocks' KV is not that of the same tokens in a shorter one (hashed apart:
        # kv_cache/hashing.py)
        self.long_rope = False
        self.lora_id = lora_id
        # (start offset, length, content hash) of multimodal placeholders
        self.mm_hashes = mm_hashes or []
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.spec_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_tokens_sent = 0  # of all_token_ids, the runner's ranks that do not sample have (pipeline stages)
        self.num_cached_tokens = -1  # prefix-cache hit of the first scheduling
        # of its computed tokens when next handed to the runner, those whose KV a connector supplied (the
        # target's only: a draft model catches up over them)
        self.num_external_tokens = 0
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.stop_reason: Any = None
        self.block_hashes: list[Any] = []  # one per full block, chained
        self.kv_transfer_params: Optional[dict] = None  # what a KV connector returned as it finished (for a peer)
        self.first_scheduled_time: Optional[float] = None
        # the output constraint's state (``core.RequestGrammar``), None when unconstrained
        self.grammar = grammar
        if grammar is not None and not grammar.ready():
            self.status = RequestStatus.WAITING_FOR_GRAMMAR

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def max_tokens(self) -> Optional[int]:
        return self.sampling_params.max_tokens

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    @property
    def finish_reason(self) -> Optional[str]:
        return RequestStatus.finish_reason(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"status={self.status.name})"
        )
