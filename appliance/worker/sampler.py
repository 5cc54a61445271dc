"""Sampling from the LM head's logits, one row per sampling request.

Order of operations (as vLLM's): logprobs of the raw logits are taken
first; then logit bias, min_tokens masking, repetition / frequency /
presence penalties; greedy rows take the argmax; the others apply
temperature, top-k, top-p and min-p and draw with the exponential race
(argmax of p / q with q ~ Exp(1)) from their own generator, so a seeded
request draws the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from appliance.sampling_params import SamplingParams


@dataclass
class SampleRequest:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: Optional[torch.Generator]
    stop_ids: tuple[int, ...]  # eos (unless ignore_eos) + stop_token_ids, masked below min_tokens


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


def _penalize(logits: torch.Tensor, r: SampleRequest) -> None:
    p = r.params
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
        logits[ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
    if len(r.output_token_ids) < p.min_tokens and r.stop_ids:
        logits[list(r.stop_ids)] = float("-inf")
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(r.prompt_token_ids) | set(r.output_token_ids)), dtype=torch.long)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and r.output_token_ids:
        counts = torch.bincount(torch.tensor(r.output_token_ids, dtype=torch.long), minlength=logits.shape[0])
        counts = counts[: logits.shape[0]].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _filter(probs: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    if p.top_k > 0 and p.top_k < probs.shape[0]:
        kth = torch.topk(probs, p.top_k).values[-1]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if p.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, 0)
        drop = cum - sorted_p > p.top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, idx, sorted_p)
    if p.min_p > 0.0:
        probs = torch.where(probs < p.min_p * probs.max(), torch.zeros_like(probs), probs)
    return probs


def sample(logits: torch.Tensor, reqs: list[SampleRequest], default_generator: torch.Generator):
    """Returns (token ids, logprobs or None per row)."""
    logits = logits.float()
    want_lp = [r.params.logprobs is not None for r in reqs]
    raw_lp = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
    tokens: list[int] = []
    logprobs: list[Optional[TokenLogprobs]] = []
    for i, r in enumerate(reqs):
        row = logits[i].clone()
        _penalize(row, r)
        p = r.params
        if p.greedy:
            tok = int(torch.argmax(row))
        else:
            probs = _filter(torch.softmax(row / p.temperature, dim=-1), p)
            q = torch.empty_like(probs).exponential_(generator=r.generator or default_generator)
            tok = int(torch.argmax(probs / q))
        tokens.append(tok)
        if want_lp[i]:
            lp = raw_lp[i]
            n = p.logprobs
            top = torch.topk(lp, n) if n else None
            rank = int((lp > lp[tok]).sum()) + 1
            logprobs.append(TokenLogprobs(
                tok, float(lp[tok]), rank,
                list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else [],
            ))
        else:
            logprobs.append(None)
    return tokens, logprobs
