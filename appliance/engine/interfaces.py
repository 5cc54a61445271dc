"""What the engine core talks to, as protocols (the engine imports no
implementation of them): the model side of a step (``StepRunner``,
``PipelinedStepRunner``, their ``StepOutput``), output constraints
(``GrammarSource``, ``RequestGrammar``), a KV connector's scheduler side
(``KVConnectorScheduler``), engine cores in lock-step (``Lockstep``), the
KV events' sink (``EventSink``); and ``EngineDeadError``, the one error
that ends an engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Protocol, runtime_checkable

if TYPE_CHECKING:
    from appliance.engine.kv_connector import KVConnectorOutput
    from appliance.engine.request import Request
    from appliance.engine.scheduler_output import SchedulerOutput
    from appliance.sampling_params import SamplingParams


class SampledLogprob(Protocol):
    """What the model runner reports per sampled token (``worker.sampler.TokenLogprobs``)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


class StepOutput(Protocol):
    """What ``runner.execute`` returns (``worker.model_runner.RunnerOutput``)."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[Optional[SampledLogprob]]]
    spec_token_ids: dict[str, list[int]]  # drafts proposed for the next step (speculative decoding)
    # (the prompt index of the first token scored, logprobs from it on) for requests asking for prompt logprobs
    prompt_logprobs: dict[str, tuple[int, list[SampledLogprob]]]
    expert_stats: Optional[dict]  # expert load balancing's figures (models/eplb.py Eplb.stats); None: no balancer
    kv_connector_output: Optional[KVConnectorOutput]  # what a KV connector's worker side finished; None: none


class RequestGrammar(Protocol):
    """One request's output constraint (``structured_output.RequestGrammar``):
    a matcher that has accepted the request's output tokens."""

    error: Optional[str]  # why compiling failed

    def ready(self) -> bool: ...  # compiled (or failed)

    def accept(self, token_ids: list[int]) -> int: ...  # how many were accepted, in order

    def is_terminated(self) -> bool: ...

    def valid_prefix(self, drafts: list[int]) -> int: ...


class GrammarSource(Protocol):
    """Compiles constraints and masks steps (``structured_output.Grammars``)."""

    # ValueError: an invalid constraint; the prompt tells whether a reasoning model's answer starts at once
    def grammar_for(self, params: SamplingParams, prompt_token_ids: list[int]) -> RequestGrammar: ...

    def bitmask(self, entries: list[tuple[str, RequestGrammar, list[int], list[int]]]) -> object: ...

    def wait(self, timeout: float) -> None: ...

    def take_compile_seconds(self) -> list[float]: ...


class EngineDeadError(RuntimeError):
    """The model side cannot run steps any more (a worker process died, or
    a step outlasted its timeout, e.g. a hung collective): no request's
    fault, and no retry helps; the engine stops (a server's supervisor
    starts a new core). A server's client raises it too, to the requests
    of a core that died (``EngineRestartingError`` while a new one starts)."""


class Lockstep(Protocol):
    """Engine cores that must run their forwards together (expert
    parallelism across data-parallel cores, ``worker.lockstep``): the host's
    loop asks ``agree`` before each step and runs ``idle_step`` when others
    have work and this core has none."""

    idle_poll_ms: int  # how long an idle core waits for input between agreements

    def agree(self, has_work: bool, stopping: bool) -> tuple[bool, bool]: ...  # (any has work, all stopping)

    def idle_step(self) -> None: ...


class EventSink(Protocol):
    """Where the block pool's events go after each step (``server.kv_events.KVEventPublisher``)."""

    def publish(self, events: list) -> None: ...

    def close(self) -> None: ...


class StepRunner(Protocol):
    """The model side of a step (``worker.model_runner.ModelRunner``).

    A runner over pipeline stages (``worker.executor``) also has
    ``num_stages``, ``max_batches_in_flight`` (one per stage, unless the
    steps must pair up with other cores'), ``submit(sched_out)`` and
    ``collect()`` (the oldest submitted step's output): the core keeps
    that many steps in flight so the stages overlap."""

    def execute(self, sched_out: SchedulerOutput) -> StepOutput: ...


class PipelinedStepRunner(StepRunner, Protocol):
    """A step runner over pipeline stages (``worker.executor``): the core keeps up to
    ``max_batches_in_flight`` steps submitted and collects them oldest first."""

    num_stages: int
    max_batches_in_flight: int

    def submit(self, sched_out: SchedulerOutput) -> None: ...

    def collect(self) -> StepOutput: ...


@runtime_checkable
class KVConnectorScheduler(Protocol):
    """A KV connector's scheduler side (vLLM V1's scheduler-role connector),
    which the scheduler and the core call: ``engine/kv_connector.
    OffloadConnector`` and ``engine/kv_p2p.P2PConnector``; the runner builds
    one per ``kv_transfer.connector`` (``config/kv_connectors.py``), with
    its worker side beside the model. Every step it answers which tokens it
    can supply past the pool's hits, takes the blocks allocated for them,
    turns the step into instructions for its worker side, and learns what
    the worker side finished; a finished request's blocks may stay held
    while a peer still needs them."""

    name: str  # kv_transfer.connector
    role: str  # kv_transfer.role
    recving: dict[str, int]  # requests loading in the background -> their computed tokens once the load is in
    first_loaded_block: dict[str, int]  # this step's synchronous loads: each request's first loaded block
    corrupt_blocks: int  # stored blocks that failed their checks on load (recomputed)
    has_pending_meta: bool  # instructions not handed to the worker side yet: one more step is due
    has_transfers: bool  # KV moving (or held for a peer) that an idle engine must keep stepping for

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]: ...

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_local_tokens: int,
                                 num_external_tokens: int) -> None: ...

    def build_connector_meta(self, scheduled: dict[str, int], requests: dict[str, Request],
                             block_ids: Callable[[str], list[int]]) -> object: ...

    def update_connector_output(self, output: Optional[KVConnectorOutput]) -> None: ...

    def combine_ranks(self, output: KVConnectorOutput) -> KVConnectorOutput: ...

    def overdue(self) -> Optional[KVConnectorOutput]: ...

    def step_failed(self, meta: object) -> None: ...  # what its build_connector_meta made for the step

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, Optional[dict]]: ...
