"""The model runner: turns a SchedulerOutput into one forward and samples.

It keeps a persistent input batch: each live request owns a row of a
preallocated block table per KV-cache group, each growing by the step's
new block ids of its group, and its token ids; finished and preempted
requests give their rows back. A model with several groups (sliding-window
layers beside full-attention ones) gets the attention metadata of each
layer's group; its layers share the cache tensors as the layout places
them (``config/kv_groups.py``). Per step it builds input ids, positions,
slot mapping and ``query_start_loc`` for the flattened batch, runs the model with the
attention backend's metadata, and samples the requests that reached the
end of their known tokens (a mid-prompt chunk samples nothing).

With speculative decoding a request's step also carries the drafts the
scheduler sent (after its real tokens): the step returns logits at each
draft position and one past them, ``sampler.verify_drafts`` emits the
accepted drafts and one more token, and the proposer drafts for the next
step from the request's tokens as they now stand, at most as many as its
recent acceptance warrants (``draft_limit``: one more than were accepted
after a rejection, growing by one after a run fully accepted, up to
``num_speculative_tokens``), since every draft position costs a row of
the verifying forward whether it is accepted or not. A seeded request draws
each position's randomness from a generator seeded by (seed, position),
so its text is the same alone, in any batch, after preemption and after a
retried step, with or without n-gram drafts (see ``sampler``).

A request that asks for prompt logprobs gets a row of logits at each
prompt position its chunk computes (but the last, which samples): row q
scores prompt token q + 1, so every prompt token but the first is scored
once as its prefill goes by (``prompt_logprobs``, rows after the sampling
rows).

On a pipeline stage before the last the step ends once the stage's rows
are handed on: it samples, scores and drafts nothing (``samples`` is
False), and it learns the requests' new tokens from the scheduler
(``CachedRequestData.new_token_ids``). Every step makes its hand-offs,
failed or not (``PipelineParallel.begin``/``abandon``), so the stages stay
in step.

The runner, not the model, chooses how a step runs: a backend that says
``native_forward`` (cpu_native) runs the whole step in one native call,
built by ``backend.build_native_forward(model)`` from the model's public
``weights_view()``; any other backend runs the model's torch forward,
which calls the backend per layer for attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence, cast

import numpy as np
import torch

from appliance.engine.scheduler_output import SchedulerOutput
from appliance.engine.kv_cache.single_type import FULL_ATTENTION, KVCacheGroupSpec
from appliance.kernels.base import AttentionBackend, CommonAttentionMetadata
from appliance.sampling_params import SamplingParams
from appliance.worker.kv_memory import copy_kv_blocks, zeroed_kv_cache
from appliance.worker.sampler import (SampleRequest, TokenLogprobs, position_generator, prompt_logprobs, sample,
                                      verify_drafts)


def runs_native_forward(backend: Any, model: Any) -> bool:
    """Whether steps of ``model`` run the backend's whole-step native
    forward: where the backend has one, for the whole model, a
    tensor-parallel rank (its all-reduces run inside the native call; with
    expert parallelism over those ranks, their whole experts' partial sums
    reduced as a sliced expert's are) or a pipeline stage (its layers in one
    call, the rows handed on between calls); not for expert parallelism
    across engine cores (its exchange of tokens is not built into the call)
    or under the load balancer (its slots are not), nor for a model whose
    layers are not the Llama family's (``llama_layers`` False: OLMo 2's
    norms after attention and MLP), which the native forward computes."""
    if not backend.native_forward or not getattr(model, "llama_layers", True):
        return False
    ep = getattr(model, "ep", None)
    return ep is None or (ep.replicated and getattr(model, "tp", None) is not None
                          and getattr(model, "eplb", None) is None)


def rope_table_rows(model: Any, positions: np.ndarray, states: list[CachedRequestState],
                    counts: np.ndarray) -> np.ndarray:
    """The rope-table row of each token of a step (``counts[i]`` tokens of ``states[i]`` in turn): its position, or
    for a LongRoPE model (``model.rope_long``) the long row where its sequence holds more tokens than the original
    context (``models/layers/rotary.rope_long_rows``): at every position, as the scheduler computes a sequence
    again when it grows past that (``Scheduler._restart_long``). A request's rows depend on its own tokens alone,
    whatever shares the step and however its prompt is chunked."""
    long = getattr(model, "rope_long", None)
    if long is None:
        return positions
    original, offset = long
    lengths = np.fromiter((len(s.token_ids) for s in states), dtype=np.int64, count=len(states))
    return positions + offset * np.repeat(lengths > original, counts)


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    params: SamplingParams
    row: int
    stop_ids: tuple[int, ...]
    spec: list[int] = field(default_factory=list)  # drafts scheduled this step, after token_ids
    draft_limit: int = 0  # the most drafts to propose next (adapted to acceptance); 0: not drafting
    # a draft model's: positions its K/V holds for the real tokens, drafts it was fed past them (valid as far
    # as they are accepted), and the distributions sampled drafts were drawn from
    draft_computed: int = 0
    draft_fed: int = 0
    draft_q: Optional[torch.Tensor] = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass
class RunnerOutput:
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[Optional[TokenLogprobs]]] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)  # drafts for the next step
    # requests that asked for prompt logprobs: (the prompt index of the first token scored, its logprobs on)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    expert_stats: Optional[dict] = None  # expert load balancing's figures (models/eplb.py Eplb.stats)
    kv_connector_output: Any = None  # what the KV connector's worker side finished (engine/kv_connector.py)


class ModelRunner:
    def __init__(
        self,
        model: Any,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
        device: torch.device,
        eos_token_id: Optional[int],
        seed: int = 0,
        proposer: Optional[Any] = None,
        disable_spec_above: Optional[int] = None,
        bitmask_kernel: Optional[Callable] = None,
        kv_groups: Sequence[KVCacheGroupSpec] = (FULL_ATTENTION,),
        layer_placement: Optional[dict[int, tuple[int, int]]] = None,
    ):
        arch = model.arch
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.eos_token_id = eos_token_id
        self.bitmask_kernel = bitmask_kernel  # masks constrained logits rows (None: xgrammar's kernel)
        shape = backend.kv_cache_shape(num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
        # The cache of each layer this rank holds (a pipeline stage's): its own tensor, or (several KV-cache
        # groups, layer_placement: each layer's (group, tensor)) the tensor it shares with a layer of each
        # other group, a block of its group being page b of it (config/kv_groups.py).
        pp = getattr(model, "pp", None)
        layers = range(len(model.model.layers)) if pp is None else range(pp.start, pp.end)
        placement = layer_placement or {i: (0, i) for i in layers}
        tensors: dict[int, torch.Tensor] = {}
        for i in layers:
            if placement[i][1] not in tensors:
                tensors[placement[i][1]] = zeroed_kv_cache(shape, dtype=kv_dtype, device=device)
        self.kv_caches = [tensors[placement[i][1]] for i in layers]
        self.kv_groups = tuple(kv_groups)
        self.layer_groups = [placement[i][0] for i in layers]
        self.max_blocks_per_req = -(-max_model_len // block_size)
        # a block table per group: [group, row, block]
        self.block_table = np.zeros((len(self.kv_groups), max_num_seqs, self.max_blocks_per_req), dtype=np.int32)
        self.num_blocks_in_row = np.zeros((len(self.kv_groups), max_num_seqs), dtype=np.int32)
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.requests: dict[str, CachedRequestState] = {}
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.proposer = proposer
        self.disable_spec_above = disable_spec_above  # no drafts while more requests than this run
        model.rope_cache(max_model_len, dtype, device)
        # Decided here; the native forward itself is built at the first step, so it
        # sees the weights as they are then (quantized, or edited after construction).
        self.uses_native_forward = runs_native_forward(backend, model)
        self.samples = pp is None or pp.last  # a pipeline stage before the last hands its rows on instead
        self.kv_connector: Any = None  # a KV connector's worker side (worker/kv_offload.py, kv_p2p.py), set by the runner
        self._native: Any = None
        self._native_rope: Any = None  # the model's rope tables the native forward was built with

    def step_forward(self) -> Callable[..., torch.Tensor]:
        """What runs this step: ``f(input_ids, positions, kv_caches, metadata,
        logits_indices) -> fp32 logits``. The native forward is (re)built when
        it is missing or the model's rope tables changed since it was built."""
        if not self.uses_native_forward:
            return self.model
        rope = self.model.rope
        if self._native is None or self._native_rope is not rope:
            self._native = self.backend.build_native_forward(self.model)
            self._native_rope = rope
        return self._native

    # -- persistent batch ----------------------------------------------------
    def _remove(self, rid: str) -> None:
        st = self.requests.pop(rid, None)
        if st is not None:
            self.num_blocks_in_row[:, st.row] = 0
            self.free_rows.append(st.row)

    def _append_blocks(self, row: int, block_ids: tuple[list[int], ...]) -> None:
        """Each group's new blocks after the ones its row holds."""
        for g, ids in enumerate(block_ids):
            n = self.num_blocks_in_row[g, row]
            self.block_table[g, row, n : n + len(ids)] = ids
            self.num_blocks_in_row[g, row] = n + len(ids)

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self._remove(rid)
        for new in so.scheduled_new_reqs:
            self._remove(new.req_id)  # a resumed request starts over
            p = new.sampling_params
            stop_ids = tuple(p.stop_token_ids) + (() if p.ignore_eos or self.eos_token_id is None else (self.eos_token_id,))
            st = CachedRequestState(new.req_id, list(new.token_ids), new.num_prompt_tokens, new.num_computed_tokens,
                                    p, self.free_rows.pop(), stop_ids,
                                    draft_limit=self.proposer.k if self.proposer is not None else 0,
                                    draft_computed=new.num_computed_tokens - new.num_external_tokens)
            self.requests[new.req_id] = st
            self._append_blocks(st.row, new.block_ids)
        for c in so.scheduled_cached_reqs:
            st = self.requests[c.req_id]
            st.num_computed_tokens = c.num_computed_tokens
            if c.new_token_ids is not None and not self.samples:  # it learns the tokens from the scheduler
                st.token_ids.extend(c.new_token_ids)
            st.spec = so.scheduled_spec_decode_tokens.get(c.req_id, [])
            self._append_blocks(st.row, c.new_block_ids)

    # -- one step ------------------------------------------------------------
    def batch_inputs(self, states: list[CachedRequestState], computed: np.ndarray, counts: np.ndarray,
                     input_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[CommonAttentionMetadata], np.ndarray]:
        """The flattened batch of ``counts[i]`` tokens per request from
        position ``computed[i]`` (``input_ids`` in that order), through the
        requests' block-table rows: (input ids, positions, metadata per
        KV-cache group, query_start_loc)."""
        n_reqs = len(states)
        qsl = np.zeros(n_reqs + 1, dtype=np.int64)
        np.cumsum(counts, out=qsl[1:])
        total = int(qsl[-1])
        # positions: computed[i] + 0..counts[i]-1 for each request, flattened
        req_of_token = np.repeat(np.arange(n_reqs), counts)
        positions = computed[req_of_token] + (np.arange(total) - qsl[:-1][req_of_token])
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=n_reqs)
        seq_lens = computed + counts
        dev = self.device
        tables = [self._group_inputs(g, rows, req_of_token, positions) for g in range(len(self.kv_groups))]
        common = CommonAttentionMetadata(
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            num_computed_tokens=torch.from_numpy(computed.astype(np.int32)).to(dev),
            block_table=tables[0][0],
            slot_mapping=tables[0][1],
            block_size=self.block_size,
            num_reqs=n_reqs,
            num_actual_tokens=total,
            max_query_len=int(counts.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=qsl.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            sliding_window=self.kv_groups[0].sliding_window,
            attention_chunk=self.kv_groups[0].attention_chunk,
        )
        groups = [common] + [replace(common, block_table=bt, slot_mapping=slots, sliding_window=spec.sliding_window,
                                     attention_chunk=spec.attention_chunk)
                             for (bt, slots), spec in zip(tables[1:], self.kv_groups[1:])]
        return input_ids, positions, groups, qsl

    def _group_inputs(self, group: int, rows: np.ndarray, req_of_token: np.ndarray,
                      positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """A KV-cache group's block-table rows of the batch and the slots its tokens write."""
        bt = self.block_table[group, rows]
        slots = bt[req_of_token, positions // self.block_size].astype(np.int64) * self.block_size + (
            positions % self.block_size)
        return torch.from_numpy(bt).to(self.device), torch.from_numpy(slots).to(self.device)

    def attention_metadata(self, groups: list[CommonAttentionMetadata]) -> Any:
        """What the model's layers attend with: the backend's metadata of the
        one group, or a list of each layer's group's."""
        built = [self.backend.build_metadata(c) for c in groups]
        return built[0] if len(built) == 1 else [built[g] for g in self.layer_groups]

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        out = RunnerOutput()
        try:
            return self._execute(so, out)
        except Exception as e:
            # what a KV connector reported finished is not lost with the step (the engine core applies it)
            cast(Any, e).kv_connector_output = out.kv_connector_output
            raise

    @torch.inference_mode()
    def _execute(self, so: SchedulerOutput, out: RunnerOutput) -> RunnerOutput:
        pp = getattr(self.model, "pp", None)
        if pp is None or not so.num_scheduled_tokens:
            return self._step(so, out)
        pp.begin()
        try:
            return self._step(so, out)
        except BaseException:  # the stages before and after this one still make the step's hand-offs
            pp.abandon((so.total_num_scheduled_tokens, self.model.arch.hidden_size), self.device)
            raise

    def _step(self, so: SchedulerOutput, out: RunnerOutput) -> RunnerOutput:
        if so.blocks_to_copy:  # forks' copies on write, before any layer writes
            copy_kv_blocks(self.kv_caches, so.blocks_to_copy)
        self._update_states(so)
        connector = self.kv_connector
        if connector is not None:  # blocks the scheduler gave to a connector's tokens, filled before any layer runs
            connector.start_load_kv(so.kv_connector_metadata, self.kv_caches)
        if not so.num_scheduled_tokens:
            if connector is not None:
                out.kv_connector_output = connector.get_finished()
            return out
        rids = list(so.num_scheduled_tokens)
        n_reqs = len(rids)
        states = [self.requests[r] for r in rids]
        counts = np.fromiter((so.num_scheduled_tokens[r] for r in rids), dtype=np.int64, count=n_reqs)
        computed = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=n_reqs)
        input_ids = np.concatenate([np.asarray((s.token_ids + s.spec if s.spec else s.token_ids)[c : c + n],
                                               dtype=np.int64) for s, c, n in zip(states, computed, counts)])
        input_ids, positions, groups, qsl = self.batch_inputs(states, computed, counts, input_ids)
        rows = rope_table_rows(self.model, positions, states, counts)
        seq_lens = computed + counts
        sampling = [i for i, s in enumerate(states) if seq_lens[i] >= len(s.token_ids)]
        # a request verifying drafts gets a row at each draft position and one past them
        num_drafts = [len(states[i].spec) for i in sampling]
        # then, for prompt logprobs, a row at each prompt position of the chunk that does not sample
        scored = [(i, int(computed[i]), min(int(seq_lens[i]), s.num_prompt_tokens - 1)) for i, s in enumerate(states)
                  if s.params.prompt_logprobs is not None and computed[i] < s.num_prompt_tokens - 1]
        logits_indices = np.concatenate(
            [np.arange(qsl[i + 1] - 1 - nd, qsl[i + 1]) for i, nd in zip(sampling, num_drafts)]
            + [np.arange(qsl[i], qsl[i] + end - c) for i, c, end in scored] + [np.zeros(0, dtype=np.int64)])
        dev = self.device
        metadata = self.attention_metadata(groups)
        whole_step = self.uses_native_forward  # its layers run in one call: the connector's layer hooks go around it
        if connector is not None and whole_step:
            for i in range(len(self.kv_caches)):
                connector.wait_for_layer_load(i)
        self.model.kv_layer_hooks = None if whole_step else connector
        logits = self.step_forward()(
            torch.from_numpy(input_ids).to(dev),
            torch.from_numpy(rows).to(dev),
            self.kv_caches,
            metadata,
            torch.from_numpy(logits_indices).to(dev),
        )
        for i, s in enumerate(states):
            s.num_computed_tokens = int(seq_lens[i])
        if connector is not None:  # every stage saves its layers' part
            if whole_step:
                for i, cache in enumerate(self.kv_caches):
                    connector.save_kv_layer(i, cache)
            connector.wait_for_save()
            out.kv_connector_output = connector.get_finished()
        if logits is None:  # a pipeline stage before the last: its rows went on, the last stage samples
            return out
        eplb = getattr(self.model, "eplb", None)
        if eplb is not None:
            out.expert_stats = eplb.stats()
        if sampling or scored:  # sampling runs on host logits; a chunk that samples nothing has none to copy
            logits = logits.cpu()
        num_sample_rows = len(sampling) + sum(num_drafts)
        if scored:
            self._score_prompts(logits[num_sample_rows:], [(states[i], c, end) for i, c, end in scored], out)
        if sampling:
            self._sample(logits[:num_sample_rows], [states[i] for i in sampling], num_drafts, out,
                         so.grammar_bitmask)
        if self.proposer is not None:
            # the real tokens each request now has K/V for (and, for one that sampled, its new last token)
            ends = [len(s.token_ids) if s.req_id in out.sampled_token_ids else int(seq_lens[i])
                    for i, s in enumerate(states)]
            enabled = self.disable_spec_above is None or len(self.requests) <= self.disable_spec_above
            drafts = self.proposer.draft_step(self, states, ends, set(out.sampled_token_ids), enabled)
            for rid, (tokens, q) in drafts.items():
                if tokens:
                    out.spec_token_ids[rid] = tokens
                    self.requests[rid].draft_q = q
        return out

    @staticmethod
    def _score_prompts(logits: torch.Tensor, spans: list[tuple[CachedRequestState, int, int]],
                       out: RunnerOutput) -> None:
        """Rows for positions ``start..end - 1`` of each request in turn score its prompt tokens ``start + 1..end``."""
        row = 0
        for s, start, end in spans:
            n = end - start
            assert s.params.prompt_logprobs is not None  # the spans are of requests that asked
            out.prompt_logprobs[s.req_id] = (start + 1, prompt_logprobs(
                logits[row : row + n], s.token_ids[start + 1 : end + 1], s.params.prompt_logprobs))
            row += n

    def _row(self, s: CachedRequestState, drafted: list[int]) -> SampleRequest:
        """``s`` as of the position after its tokens and ``drafted``."""
        seed = s.params.seed
        gen = None if seed is None else position_generator(seed, len(s.token_ids) + len(drafted))
        outputs = s.output_token_ids + drafted if drafted else s.output_token_ids
        return SampleRequest(s.params, s.token_ids[: s.num_prompt_tokens], outputs, gen, s.stop_ids)

    def _sample(self, logits: torch.Tensor, states: list[CachedRequestState], num_drafts: list[int],
                out: RunnerOutput, grammar_bitmask: Any = None) -> None:
        """Rows in order: a plain request's one row, a drafting request's
        1 + drafts; plain requests are sampled together. Rows of requests
        with an output constraint are masked to what their grammar allows
        first."""
        starts = np.concatenate([[0], np.cumsum([1 + nd for nd in num_drafts])])
        if grammar_bitmask is not None:
            grammar_bitmask.apply(logits, {s.req_id: int(starts[j]) for j, s in enumerate(states)},
                                  self.bitmask_kernel)
        plain = [j for j, nd in enumerate(num_drafts) if nd == 0]
        if plain:
            tokens, lps = sample(logits[torch.as_tensor(starts[plain])], [self._row(states[j], []) for j in plain], self.generator)
            for j, tok, lp in zip(plain, tokens, lps):
                self._emit(states[j], [tok], [lp], out)
        for j, nd in enumerate(num_drafts):
            if nd:
                s = states[j]
                rows = [self._row(s, s.spec[:t]) for t in range(nd + 1)]
                q = s.draft_q[:nd] if s.draft_q is not None else None
                emitted, lps = verify_drafts(logits[starts[j] : starts[j + 1]], rows, s.spec, self.generator, q)
                s.num_computed_tokens -= nd + 1 - len(emitted)  # rejected positions are recomputed
                accepted = len(emitted) - 1
                assert self.proposer is not None  # drafts come from it
                s.draft_limit = min(self.proposer.k, s.draft_limit + 1) if accepted == nd else accepted + 1
                s.draft_computed += min(accepted, s.draft_fed)  # fed drafts that proved real
                self._emit(s, emitted, lps, out)

    @staticmethod
    def _emit(s: CachedRequestState, tokens: list[int], lps: list[Optional[TokenLogprobs]], out: RunnerOutput) -> None:
        s.token_ids.extend(tokens)
        s.spec, s.draft_fed, s.draft_q = [], 0, None
        out.sampled_token_ids[s.req_id] = tokens
        if lps[0] is not None:
            out.logprobs[s.req_id] = lps
