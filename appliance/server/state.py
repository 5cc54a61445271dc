"""What every handler of the HTTP front end reads: the deployment, the
engine client, the tokenizer (and a harmony model's chat format), metrics,
keys, and the counters of admitted and running generations."""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from appliance.config.compose import ResolvedConfig
from appliance.config.deployment import Deployment
from appliance.config.schema import ApplianceConfig
from appliance.server.data_parallel import DataParallelClient
from appliance.server.harmony import HarmonyChat, harmony_chat
from appliance.server.metrics import Metrics
from appliance.server.response_store import ResponseStore

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from appliance.server.generation import Generation
    from appliance.server.tracing import Tracing


@dataclass
class ServerState:
    deployment: Deployment
    client: DataParallelClient
    tokenizer: PreTrainedTokenizerBase
    metrics: Metrics
    api_keys: tuple[str, ...]  # empty: no authentication (appliance.server.auth)
    internal_key: Optional[bytes] = None  # what this deployment's router signs internal requests with
    shutting_down: bool = False
    in_flight: int = 0  # admitted engine requests (children) not yet finished
    tokenize_pool: Optional[Executor] = None  # tokenization and chat templates (None: the loop's default executor)
    generations: set[Generation] = field(default_factory=set)  # running generations (a drain cuts them)
    cut_reason: Optional[str] = None  # set when a drain has cut running generations
    tracing: Optional[Tracing] = None  # server.otlp_traces_endpoint: a span per request
    stored_responses: ResponseStore = field(init=False)  # the Responses API's store, made from the config
    harmony: Optional[HarmonyChat] = None  # a harmony model's chat format (gpt-oss); loaded here when not given

    def __post_init__(self) -> None:
        s = self.cfg.server
        self.stored_responses = ResponseStore(s.responses_store_max, s.responses_store_mib << 20)
        if self.harmony is None:
            self.harmony = harmony_chat(self.cfg, self.tokenizer)

    @property
    def resolved(self) -> ResolvedConfig:
        return self.deployment.resolved

    @property
    def cfg(self) -> ApplianceConfig:
        return self.deployment.cfg

    @property
    def model_name(self) -> str:
        return self.deployment.model_name

    @property
    def max_model_len(self) -> int:
        return self.deployment.max_model_len

    @property
    def max_prompt_chars(self) -> int:
        return self.deployment.max_prompt_chars

    @property
    def max_queue_len(self) -> int:
        return self.cfg.server.max_queue_len
