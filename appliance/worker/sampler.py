"""Sampling from the LM head's logits, one row per sampling request, and
verifying speculative drafts against them.

Order of operations (as vLLM's): logprobs of the raw logits are taken
first; then allowed_token_ids and bad_words masking, logit bias, min_tokens masking, repetition / frequency /
presence penalties; greedy rows take the argmax; the others apply
temperature, top-k, top-p and min-p and draw by the inverse of their
cumulative distribution (the first token whose running sum of p passes
U times the row's total, U uniform, one draw a row from its own
generator), so a seeded request draws the same tokens whatever else is in
the batch.

``verify_drafts`` is the rejection sampler: a request with k draft tokens
brings k + 1 rows (the target's distribution at each draft position and
one past them), each processed as above with the drafts before it counted
as output (penalties, min_tokens). Greedy: drafts are accepted while they
equal the row's argmax, then the argmax is emitted (all accepted: the
last row's, a bonus token). Random: draft d is accepted with probability
min(1, p(d) / q(d)), q being the proposer's distribution, and the first
rejection emits a draw from normalize(max(p - q, 0)) and ends the run; all
accepted, a bonus draw from the last row. Every emitted token is thereby
distributed exactly as without drafts. Drafts given without q (n-gram: q
one-hot) take the same acceptance, p(d), in its exact form: each position
draws its token as plain sampling would (the same draw from the same
generator) and the draft is accepted when it is that token, so a seeded
request emits the very tokens it would without drafts.

A seeded request draws the token at position i from a generator seeded by
(seed, i) (``position_generator``): its text is the same alone or in any
batch, after preemption or a retried step, with or without n-gram drafts
(a draft model's drafts change which draws it makes).
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


def _in_vocab(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return ids[(ids >= 0) & (ids < vocab)]  # ids came from the model or a checked prompt: int64 already


def _penalize(logits: torch.Tensor, r: SampleRequest) -> None:
    """Token ids outside the vocabulary are skipped: the API refuses them,
    and one that slips through must not take the batch down."""
    p = r.params
    vocab = logits.shape[0]
    if p.allowed_token_ids is not None:
        allowed = _in_vocab(torch.tensor(p.allowed_token_ids, dtype=torch.long), vocab)
        kept = logits[allowed].clone()
        logits.fill_(float("-inf"))
        logits[allowed] = kept
    for word in p.bad_words_token_ids:
        *before, last = word
        out = r.output_token_ids
        if 0 <= last < vocab and len(before) <= len(out) and out[len(out) - len(before):] == before:
            logits[last] = float("-inf")
    if p.logit_bias:
        bias = {t: b for t, b in p.logit_bias.items() if 0 <= t < vocab}
        logits[torch.tensor(list(bias), dtype=torch.long)] += torch.tensor(list(bias.values()), dtype=logits.dtype)
    if len(r.output_token_ids) < p.min_tokens and r.stop_ids:
        stops = [t for t in r.stop_ids if 0 <= t < vocab]
        kept = logits[stops].clone()
        logits[stops] = float("-inf")
        if bool(torch.isneginf(logits).all()):  # an output constraint allows nothing else: it wins
            logits[stops] = kept
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(r.prompt_token_ids) | set(r.output_token_ids)), dtype=torch.long)
        seen = _in_vocab(seen, vocab)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and r.output_token_ids:
        counts = torch.bincount(_in_vocab(torch.tensor(r.output_token_ids, dtype=torch.long), vocab), minlength=vocab)
        counts = counts[:vocab].to(logits.dtype)
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


def _needs_processing(r: SampleRequest) -> bool:
    p = r.params
    return bool(p.logit_bias or p.allowed_token_ids is not None or p.bad_words_token_ids
                or (len(r.output_token_ids) < p.min_tokens and r.stop_ids) or p.repetition_penalty != 1.0
                or ((p.frequency_penalty or p.presence_penalty) and r.output_token_ids))


_MIX = 0x9E3779B97F4A7C15  # (seed, position) -> one generator seed


def position_generator(seed: int, position: int) -> torch.Generator:
    """The generator a seeded request draws the token at ``position`` with."""
    return torch.Generator(device="cpu").manual_seed((seed * _MIX + position) % (1 << 63))


def uniforms(n: int, generator: torch.Generator) -> torch.Tensor:
    """n uniform draws in [0, 1), float64 (53 random bits each), from ``generator``."""
    return torch.rand(n, generator=generator, dtype=torch.float64)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` ([rows, vocab], nonnegative; unnormalized is fine) for the uniforms ``u``
    ([rows]): the first token whose cumulative mass exceeds u times the row's total. A token's chance moves by at
    most about one fp32 rounding of the running sum (~1e-7 of the total) at each end of its interval, and a token
    of zero mass is never drawn (its interval is empty). One uniform a row where the exponential race drew one a
    token: at 64 rows of a 49,152-token vocabulary 1.3 ms against 9.6 on a 2-core Zen 5."""
    c = probs.cumsum(-1)
    idx = torch.searchsorted(c, (u.to(c.device, torch.float64).unsqueeze(1) * c[:, -1:]).to(c.dtype), right=True)
    idx = idx.squeeze(1)
    past = idx >= probs.shape[-1]  # u * total rounded up to the total: the last token that has mass
    if bool(past.any()):
        last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(-1)
        idx = torch.where(past, last, idx)
    return idx


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``logits[rows]``, without the copy where ``rows`` are all of them in order (at 64 rows of a 49,152-token
    vocabulary the copy is longer than the argmax after it)."""
    return logits if rows == list(range(logits.shape[0])) else logits[rows]


def sample(logits: torch.Tensor, reqs: list[SampleRequest], default_generator: torch.Generator):
    """Returns (token ids, logprobs or None per row). Rows are handled in
    groups: plain greedy rows share one argmax, random rows one softmax;
    only rows with penalties, bias, min_tokens or top-k/p/min-p filters are
    processed one by one."""
    logits = logits.float()
    n = logits.shape[0]
    want_lp = [r.params.logprobs is not None for r in reqs]
    raw_lp = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
    process = [i for i, r in enumerate(reqs) if _needs_processing(r)]
    if process:
        logits = logits.clone()
        for i in process:
            _penalize(logits[i], reqs[i])
    tokens = [0] * n
    greedy = [i for i, r in enumerate(reqs) if r.params.greedy]
    if greedy:
        for i, t in zip(greedy, _rows(logits, greedy).argmax(dim=-1).tolist()):
            tokens[i] = t
    rand = [i for i, r in enumerate(reqs) if not r.params.greedy]
    if rand:
        temps = torch.tensor([reqs[i].params.temperature for i in rand], dtype=torch.float32).unsqueeze(1)
        probs = torch.softmax(_rows(logits, rand) / temps, dim=-1)
        for j, i in enumerate(rand):
            p = reqs[i].params
            if p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0:
                probs[j] = _filter(probs[j], p)
        u = torch.empty(len(rand), dtype=torch.float64)
        unseeded = [j for j, i in enumerate(rand) if reqs[i].generator is None]
        if unseeded:
            u[unseeded] = uniforms(len(unseeded), default_generator)
        for j, i in enumerate(rand):
            if (gen := reqs[i].generator) is not None:
                u[j] = uniforms(1, gen)[0]
        for i, t in zip(rand, inverse_cdf(probs, u).tolist()):
            tokens[i] = t
    logprobs: list[Optional[TokenLogprobs]] = []
    for i, r in enumerate(reqs):
        if raw_lp is None or r.params.logprobs is None:
            logprobs.append(None)
            continue
        logprobs.append(_token_logprobs(raw_lp[i], tokens[i], r.params.logprobs))
    return tokens, logprobs


def _probs(logits_row: torch.Tensor, p: SamplingParams, normalize: bool = True) -> torch.Tensor:
    """A random row's distribution: temperature, then top-k / top-p / min-p
    (renormalized unless ``normalize`` is off: the draw takes it as ``sample`` does)."""
    probs = torch.softmax(logits_row / p.temperature, dim=-1)
    if p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0:
        probs = _filter(probs, p)
        if normalize:
            probs /= probs.sum()
    return probs


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from ``probs`` (unnormalized is fine), as ``sample`` draws a row."""
    return int(inverse_cdf(probs.unsqueeze(0), uniforms(1, generator))[0])


def _token_logprobs(lp: torch.Tensor, tok: int, k: int) -> TokenLogprobs:
    top = torch.topk(lp, min(k, lp.shape[0])) if k else None
    # tokens an output constraint masked (-inf) are not candidates
    return TokenLogprobs(tok, float(lp[tok]), int((lp > lp[tok]).sum()) + 1,
                         [(i, v) for i, v in zip(top.indices.tolist(), top.values.tolist()) if v != float("-inf")]
                         if top is not None else [])


def prompt_logprobs(logits: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprobs]:
    """Row j of ``logits`` (raw, as ``sample`` takes its logprobs) scores
    ``token_ids[j]``: its log-probability, rank, and the ``k`` top candidates."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.long)
    chosen = lp.gather(1, ids.unsqueeze(1))
    ranks = ((lp > chosen).sum(dim=1) + 1).tolist()
    values = chosen.squeeze(1).tolist()
    if k:
        top = torch.topk(lp, min(k, lp.shape[1]), dim=1)
        tops = [list(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
    else:
        tops = [[] for _ in token_ids]
    return [TokenLogprobs(t, v, r, c) for t, v, r, c in zip(token_ids, values, ranks, tops)]


def verify_drafts(logits: torch.Tensor, rows: list[SampleRequest], drafts: list[int],
                  default_generator: torch.Generator, draft_probs: Optional[torch.Tensor] = None):
    """One request's drafts against its ``len(drafts) + 1`` rows of logits
    (``rows[j]``: the request as of draft position j, the drafts before it
    among its outputs, with the generator that position draws from).
    ``draft_probs`` [len(drafts), vocab] is the distribution q each draft
    was drawn from (a draft model's); None: drafts are given (n-gram), q
    one-hot. Returns (emitted token ids: the accepted drafts and one more,
    logprobs or None per emitted token); see the module docstring."""
    logits = logits.float()
    p = rows[0].params
    raw_lp = torch.log_softmax(logits, dim=-1) if p.logprobs is not None else None
    if any(_needs_processing(r) for r in rows):
        logits = logits.clone()
        for j, r in enumerate(rows):
            if _needs_processing(r):
                _penalize(logits[j], r)
    emitted: list[int] = []
    if p.greedy:
        best = logits.argmax(dim=-1).tolist()
        for j, d in enumerate(drafts):
            if d != best[j]:
                break
            emitted.append(d)
        emitted.append(best[len(emitted)])
    else:
        for j, d in enumerate(drafts):
            gen = rows[j].generator or default_generator
            if draft_probs is None:  # q one-hot: the position's own draw, accepted when it is the draft
                tok = _draw(_probs(logits[j], p, normalize=False), gen)
                emitted.append(tok)
                if tok != d:
                    break
                continue
            probs = _probs(logits[j], p)
            q_d = float(draft_probs[j, d])
            if q_d > 0 and float(torch.rand(1, generator=gen)) < float(probs[d]) / q_d:  # min(1, p(d) / q(d))
                emitted.append(d)
                continue
            residual = (probs - draft_probs[j]).clamp_(min=0.0)
            probs = residual if float(residual.sum()) > 0 else probs
            emitted.append(_draw(probs, gen))
            break
        else:
            j = len(drafts)
            emitted.append(_draw(_probs(logits[j], p, normalize=False), rows[j].generator or default_generator))
    logprobs = [None if raw_lp is None or p.logprobs is None else _token_logprobs(raw_lp[j], tok, p.logprobs)
                for j, tok in enumerate(emitted)]
    return emitted, logprobs
