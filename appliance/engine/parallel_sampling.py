"""Parallel sampling (``n``): one parent request fans out into children.

Shared by the HTTP server and the offline ``LLM`` (torch-free). A parent
over P prompts with ``params.n = n`` becomes P x n engine requests, child
``index = prompt_index * n + k``, request id ``"{parent_id}-{index}"``, each
with ``n = 1`` and, for a seeded request, ``seed + k`` (so the k-th sample
of a prompt draws the same tokens whatever else runs). Their output deltas
are merged back into one ``Child`` each, in index order.

A beam search (``params.use_beam_search``) is one engine request per prompt,
the prompt's first child's, whose one output carries the n beams
(``RequestOutputDelta.beams``): ``split`` hands beam k to child k.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Union

from appliance.engine.outputs import RequestOutputDelta, TokenLogprob
from appliance.sampling_params import SamplingParams


def child_params(params: SamplingParams, k: int) -> SamplingParams:
    """The k-th sample of a request: one sequence, seed + k when seeded (a beam search's: its n beams)."""
    if params.use_beam_search:
        return params
    return replace(params, n=1, seed=None if params.seed is None else params.seed + k)


def child_request_id(parent_id: str, index: int) -> str:
    return f"{parent_id}-{index}"


@dataclass
class Child:
    """One sample of one prompt, and what its deltas have added up to."""

    index: int  # among the parent's outputs: prompt_index * n + sample
    prompt_index: int
    request_id: str
    params: SamplingParams
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[Optional[TokenLogprob]]] = None  # a list when the request asks for logprobs
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None  # one per prompt token, when asked for
    finished: bool = False
    finish_reason: Optional[str] = None
    stop_reason: Union[str, int, None] = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    kv_transfer_params: Optional[dict] = None  # from a KV connector, with the last delta

    def __post_init__(self) -> None:
        if self.logprobs is None and self.params.logprobs is not None:
            self.logprobs = []

    def add(self, d: RequestOutputDelta) -> None:
        self.text += d.new_text
        self.token_ids.extend(d.new_token_ids)
        if self.logprobs is not None:
            self.logprobs.extend(d.logprobs)
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        self.num_prompt_tokens = d.num_prompt_tokens
        self.num_output_tokens = d.num_output_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, d.num_cached_tokens)
        if d.finished:
            self.finished = True
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason
            self.kv_transfer_params = d.kv_transfer_params


class ParentRequest:
    """The children of one request over ``num_prompts`` prompts, in index order."""

    def __init__(self, request_id: str, num_prompts: int, params: SamplingParams):
        self.request_id = request_id
        self.params = params
        n = params.n
        per_sample = [child_params(params, k) for k in range(n)]
        self.children = [Child(index=pi * n + k, prompt_index=pi, request_id=child_request_id(request_id, pi * n + k),
                               params=per_sample[k]) for pi in range(num_prompts) for k in range(n)]
        self._by_id = {c.request_id: c for c in self.children}

    def __len__(self) -> int:
        return len(self.children)

    def child(self, request_id: str) -> Child:
        return self._by_id[request_id]

    @property
    def engine_children(self) -> list[Child]:
        """The children that run as engine requests (a beam search: each prompt's first)."""
        if not self.params.use_beam_search:
            return self.children
        return self.children[:: self.params.n]

    def split(self, child: Child, d: RequestOutputDelta) -> list[tuple[Child, RequestOutputDelta]]:
        """An engine request's delta as its children's: a beam search's beams, one to each child of the prompt."""
        if d.beams is None:
            return [(child, d)]
        return [(c, RequestOutputDelta(c.request_id, b.token_ids, b.text, True, b.finish_reason, b.stop_reason,
                                       num_prompt_tokens=d.num_prompt_tokens, num_output_tokens=len(b.token_ids),
                                       num_cached_tokens=d.num_cached_tokens, queue_time=d.queue_time))
                for c, b in zip(self.children[child.index : child.index + len(d.beams)], d.beams)]

    def add(self, d: RequestOutputDelta) -> Child:
        """Merge an engine request's delta; the child it belongs to."""
        c = self._by_id[d.request_id]
        for child, delta in self.split(c, d):
            child.add(delta)
        return c

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)

    @property
    def num_cached_tokens(self) -> int:
        """The largest prefix-cache hit of any child (they share their prompt)."""
        return max((c.num_cached_tokens for c in self.children), default=0)
