"""The offline API: ``from appliance import LLM, SamplingParams``.

``LLM(overrides=[...])`` composes the same config tree as the CLI (or takes
a resolved config), builds the engine in-process, and ``generate`` /
``chat`` run requests to completion through the same scheduler the server
uses.
"""

from __future__ import annotations

import itertools
import logging
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union, cast

from appliance.config.compose import ResolvedConfig, resolve
from appliance.config.execution import Execution
from appliance.engine.outputs import TokenLogprob
from appliance.engine.parallel_sampling import ParentRequest
from appliance.errors import ConfigError
from appliance.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from appliance.kernels.registry import Selection

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]

log = logging.getLogger("appliance")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str]
    stop_reason: Union[str, int, None] = None
    logprobs: Optional[list[Optional[TokenLogprob]]] = None  # a list when the request asked for logprobs


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: each prompt token's log-probability given those before it (the first None)
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None
    # SamplingParams.kv_transfer_params with do_remote_decode: what a consumer needs to fetch the prompt's KV
    kv_transfer_params: Optional[dict] = None


PromptType = Union[str, list[int]]


class LLM:
    def __init__(self, cfg: Optional[ResolvedConfig] = None, overrides: Sequence[str] = (),
                 selection: Optional[Selection] = None):
        """``selection`` (a kernels.registry.Selection) bypasses backend
        selection, e.g. to compare one backend against another."""
        from appliance.runner import build_engine, compose, startup_lines

        resolved = cfg if cfg is not None else resolve(list(overrides))
        self.deployment = compose(resolved, selection=selection)
        dp = self.deployment.layout.data_parallel_size
        if dp > 1:
            raise ConfigError(f"parallel.data_parallel_size={dp}: data-parallel ranks are engine cores behind one "
                              f"server (appliance run); the offline LLM runs one engine core, use "
                              f"parallel.data_parallel_size=1")
        if selection is None:
            for line in startup_lines(self.deployment):
                log.warning(line)
        self.engine, self.tokenizer = build_engine(self.deployment)
        self._ids = itertools.count()

    @property
    def resolved(self) -> ResolvedConfig:
        return self.deployment.resolved

    @property
    def execution(self) -> Execution:
        return self.deployment.execution

    def _encode(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        return None, list(prompt)

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        priority: Optional[Sequence[int]] = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts, list) and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(prompts)
        else:
            params_list = list(params)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        if any(p.kv_transfer_params is not None and p.n != 1 for p in params_list):
            raise ValueError("kv_transfer_params take one sequence per request (n=1)")
        parents: list[tuple[ParentRequest, Optional[str], list[int]]] = []
        for i, (prompt, p) in enumerate(zip(prompts, params_list)):
            text, ids = self._encode(prompt)
            parent = ParentRequest(str(next(self._ids)), 1, p)
            parents.append((parent, text, ids))
            for c in parent.engine_children:
                self.engine.add_request(c.request_id, ids, c.params, priority=priority[i] if priority else 0)
        self._run([parent for parent, _, _ in parents], use_tqdm)
        return [RequestOutput(parent.request_id, text, ids,
                              [CompletionOutput(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs)
                               for c in parent.children], parent.num_cached_tokens,
                              parent.children[0].prompt_logprobs, parent.children[0].kv_transfer_params)
                for parent, text, ids in parents]

    def chat(
        self,
        messages: Union[list[dict], list[list[dict]]],
        params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
        tools: Optional[list[dict]] = None,
    ) -> list[RequestOutput]:
        """``tools`` (OpenAI function definitions) are given to the chat template;
        to force a call, constrain the output (``SamplingParams.structured_outputs``)."""
        conversations = cast(list[list[dict]], [messages] if messages and isinstance(messages[0], dict) else messages)
        prompts = [  # tokenize=False: the rendered text
            cast(str, self.tokenizer.apply_chat_template(c, tools=cast(Any, tools), tokenize=False,
                                                         add_generation_prompt=add_generation_prompt))
            for c in conversations
        ]
        ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        outs = self.generate(ids, params, use_tqdm=use_tqdm)
        for o, p in zip(outs, prompts):
            o.prompt = p
        return outs

    def _run(self, parents: list[ParentRequest], use_tqdm: bool) -> None:
        """Step until every child of ``parents`` is done, merging its deltas."""
        from tqdm import tqdm

        route = {c.request_id: parent for parent in parents for c in parent.engine_children}
        bar = tqdm(total=len(route), desc="generate", file=sys.stderr, disable=not use_tqdm or len(route) < 8)
        while self.engine.has_unfinished_requests():
            for d in self.engine.step():
                route[d.request_id].add(d)
                if d.finished:
                    bar.update(1)
        bar.close()


def generate_cli(overrides: list[str]) -> int:
    """`appliance generate prompt="..." [max_tokens=N] [temperature=T] [overrides]`."""
    prompt, max_tokens, temperature, rest = None, 64, 0.0, []
    for o in overrides:
        key, _, value = o.partition("=")
        if key == "prompt":
            prompt = value
        elif key == "max_tokens":
            max_tokens = int(value)
        elif key == "temperature":
            temperature = float(value)
        else:
            rest.append(o)
    if prompt is None:
        raise ConfigError('appliance generate needs prompt="..."')
    llm = LLM(overrides=rest)
    out = llm.chat([{"role": "user", "content": prompt}], SamplingParams(max_tokens=max_tokens, temperature=temperature),
                   use_tqdm=False)
    print(out[0].outputs[0].text)
    return 0
