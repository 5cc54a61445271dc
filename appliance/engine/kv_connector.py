"""KV connectors, scheduler side (torch-free): vLLM V1's two-sided interface.

A connector moves KV blocks between the engine's block pool and somewhere
else. Its scheduler side decides, as requests are scheduled, which tokens
it can supply (``get_num_new_matched_tokens``), records the blocks they
were given (``update_state_after_alloc``), writes each step's instructions
for the worker side into the scheduler output (``build_connector_meta``),
learns what the worker side finished (``update_connector_output``) and
says, as a request ends, whether its blocks must outlive it and what a
peer needs to fetch them (``request_finished``). The worker side
(``worker/kv_offload.py``) carries the instructions out around the
forward: loads before it, saves after it, and reports back.

``OffloadConnector`` (``kv_transfer.connector=offload``) is a second tier
on local disk keyed by block hash: one file per full block (every layer's
K and V), in a folder per model and KV layout (``tier_folder``), so
cached prefixes outlive the block pool and restarts. Each file's header
names its block and tier (``tier_identity``) and carries its payload's
checksum; a file that fails those checks on load is a miss: removed,
counted (``corrupt_blocks``) and its block recomputed. Full blocks are saved
as they fill (written by a background thread; a block counts as in the
tier once the worker reports it written); a waiting request's prefix that
continues past the pool's hits into the tier is loaded into fresh blocks
before the step's forward instead of being recomputed (the request's last
token always runs). Loads are synchronous with the step; the worker
evicts least recently used files past the size limit and reports them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Hashable, Optional

from appliance.engine.request import Request

BLOCK_SUFFIX = ".kv"


@dataclass
class OffloadMetadata:
    """One step's instructions: (block id, block hash) pairs to load into
    the pool before the forward, and to save after it."""

    loads: list[tuple[int, bytes]] = field(default_factory=list)
    saves: list[tuple[int, bytes]] = field(default_factory=list)


@dataclass
class KVConnectorOutput:
    """What the worker side finished since it last reported. An offload
    tier: block hashes now in the tier, hashes it dropped (evicted, or
    unreadable), and how many of those were files that failed their checks
    on load (damaged, another block's or tier's, an older format).
    Disaggregated prefill: requests whose remote KV is now in their
    blocks, requests whose remote KV could not be fetched (they compute it
    themselves), and finished requests whose blocks a consumer has fetched
    or stopped waiting for (their blocks may be freed)."""

    saved: list[bytes] = field(default_factory=list)
    dropped: list[bytes] = field(default_factory=list)
    finished_recving: list[str] = field(default_factory=list)
    failed_recving: list[str] = field(default_factory=list)
    finished_sending: list[str] = field(default_factory=list)
    corrupt: int = 0
    # an engine core of several ranks: each rank's report (world rank order), set by ``merge_rank_outputs``;
    # the connector's ``combine_ranks`` makes the whole report of it
    by_rank: Optional[list[KVConnectorOutput]] = None


def merge_rank_outputs(outputs: list[Optional[KVConnectorOutput]]) -> Optional[KVConnectorOutput]:
    """One report of an engine core's ranks' (world rank order; None: a rank
    with no connector output this step), each rank's kept apart."""
    if all(o is None for o in outputs):
        return None
    return KVConnectorOutput(by_rank=[o if o is not None else KVConnectorOutput() for o in outputs])


class RankTally:
    """Which of ``ranks`` ranks reported each key (a block written, a
    transfer ended): ``add`` says when the last one has."""

    def __init__(self, ranks: int):
        self.ranks = ranks
        self._seen: dict[Hashable, set[int]] = {}

    def add(self, key: Hashable, rank: int) -> bool:
        seen = self._seen.setdefault(key, set())
        seen.add(rank)
        if len(seen) < self.ranks:
            return False
        del self._seen[key]
        return True

    def forget(self, key: Hashable) -> None:
        self._seen.pop(key, None)


def layout_key(layout: dict[str, object]) -> str:
    """A short digest of a KV layout (the model's identity, its KV shape per
    block, the cache dtype, ...): two engines exchange KV blocks only when
    their keys are equal."""
    return hashlib.sha256(json.dumps(layout, sort_keys=True, default=str).encode()).hexdigest()[:16]


def tier_folder(root: str, layout: dict[str, object]) -> Path:
    """The tier's folder for one model and KV layout (``layout_key``; with
    the hash algorithm in ``layout``): blocks of another layout never load
    into this one."""
    return Path(root).expanduser() / layout_key(layout)


def tier_identity(root: str, folder: Path) -> str:
    """What a tier file in ``folder`` belongs to, as its header says: the
    folder's path under the tiers' ``root`` (the model and KV layout's
    ``layout_key``, then any data-parallel core's and rank's folders), so a
    file moved or copied between folders is not loaded."""
    return folder.relative_to(Path(root).expanduser()).as_posix()


def stored_hashes(folder: Path) -> list[bytes]:
    """The block hashes whose files are in ``folder``, least recently used first."""
    if not folder.is_dir():
        return []
    files = []
    for p in folder.iterdir():
        if p.suffix == BLOCK_SUFFIX:
            try:
                files.append((p.stat().st_mtime_ns, bytes.fromhex(p.stem)))
            except (OSError, ValueError):
                continue
    return [h for _, h in sorted(files)]


def rank_folder(folder: Path, rank: int) -> Path:
    """Rank ``rank``'s part of a tier whose engine core has several ranks
    (each rank's files hold its KV heads of its layers)."""
    return folder / f"rank{rank}"


class OffloadConnector:
    """The offload tier's scheduler side (see the module docstring; ``folder``
    None: the tier is in the ranks' host memory). With
    ``ranks`` > 1 (an engine core's tensor-parallel ranks and pipeline
    stages) each rank keeps its part of every block in its own folder
    (``rank_folder``): a block is in the tier when every rank's part is
    (at start, those in every folder; then when every rank has reported
    it written since any rank last dropped it)."""

    name, role = "offload", "both"
    has_pending_meta = False  # its instructions go with the steps that need them
    has_transfers = False  # nothing an idle engine must step for

    def __init__(self, folder: Optional[Path], block_size: int, ranks: int = 1):
        self.folder, self.block_size, self.ranks = folder, block_size, ranks
        if folder is None:  # a tier in host memory starts empty
            self.available: set[bytes] = set()
        elif ranks == 1:
            self.available = set(stored_hashes(folder))
        else:
            self.available = set.intersection(*(set(stored_hashes(rank_folder(folder, r))) for r in range(ranks)))
        self._written = RankTally(ranks)  # several ranks: the ranks that wrote their part of a block
        self.pending: set[bytes] = set()  # sent to the worker to save, not yet reported written
        self._saved_upto: dict[str, int] = {}  # per request: blocks already considered for saving
        self._loads: list[tuple[int, bytes]] = []  # this step's, until build_connector_meta
        self.first_loaded_block: dict[str, int] = {}  # this step's loads: each request's first loaded block
        self.hit_tokens = 0  # tokens loaded from the tier instead of computed
        self.corrupt_blocks = 0  # tier files that failed their checks on load (removed, their blocks recomputed)
        self.recving: dict[str, int] = {}  # none: its loads run with the step that needs them

    # -- scheduling ---------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens past ``num_computed_tokens`` the tier holds, whole blocks
        only and never the request's last token; loaded asynchronously):
        loads here are synchronous with the step (False)."""
        hashes = request.block_hashes
        start = num_computed_tokens // self.block_size
        end = min(len(hashes), (request.num_tokens - 1) // self.block_size)
        n = 0
        while start + n < end and hashes[start + n] in self.available:
            n += 1
        return n * self.block_size, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_local_tokens: int,
                                 num_external_tokens: int) -> None:
        """The blocks after the pool's hits (``block_ids``: the request's
        table) load the tier's copies this step."""
        if num_external_tokens <= 0:
            return
        first = num_local_tokens // self.block_size
        last = first + num_external_tokens // self.block_size
        self._loads += [(block_ids[i], request.block_hashes[i]) for i in range(first, last)]
        self.first_loaded_block[request.request_id] = first
        self._saved_upto[request.request_id] = max(self._saved_upto.get(request.request_id, 0), last)
        self.hit_tokens += num_external_tokens

    def build_connector_meta(self, scheduled: dict[str, int], requests: dict[str, Request],
                             block_ids: Callable[[str], list[int]]) -> OffloadMetadata:
        """This step's loads, and its saves: each scheduled request's full
        blocks whose K/V the step completes (of its known tokens: not draft
        positions) and that the tier does not hold. ``block_ids(rid)``: a
        request's block table."""
        saves = []
        for rid in scheduled:
            req = requests[rid]
            full = min(min(req.num_computed_tokens, req.num_tokens) // self.block_size, len(req.block_hashes))
            start = self._saved_upto.get(rid, 0)
            if full <= start:
                continue
            ids = block_ids(rid)
            for i in range(start, full):
                h = req.block_hashes[i]
                if h not in self.available and h not in self.pending:
                    saves.append((ids[i], h))
                    self.pending.add(h)
            self._saved_upto[rid] = full
        meta, self._loads = OffloadMetadata(self._loads, saves), []
        return meta

    def update_connector_output(self, output: Optional[KVConnectorOutput]) -> None:
        self.first_loaded_block.clear()
        if output is None:
            return
        self.corrupt_blocks += output.corrupt
        for h in output.saved:
            self.pending.discard(h)
            self.available.add(h)
        for h in output.dropped:
            self.available.discard(h)
            self.pending.discard(h)

    def combine_ranks(self, output: KVConnectorOutput) -> KVConnectorOutput:
        """The whole report of the ranks' (``output.by_rank``): a block is
        saved once every rank has written its part since any rank last
        dropped it; a part any rank dropped drops the block; every rank's
        files that failed their checks count."""
        by_rank = output.by_rank or []
        dropped = sorted({h for o in by_rank for h in o.dropped})
        for h in dropped:
            self._written.forget(h)
        saved = [h for rank, o in enumerate(by_rank) for h in o.saved if self._written.add(h, rank)]
        return KVConnectorOutput(saved=[h for h in saved if h not in dropped], dropped=dropped,
                                 corrupt=sum(o.corrupt for o in by_rank))

    def overdue(self) -> None:
        """Nothing: the tier's writes report themselves, and loads run in the step."""

    def step_failed(self, meta: Optional[OffloadMetadata]) -> None:
        """A step that failed may have loaded unreadable blocks and saved
        nothing: its loads leave the tier's index and their requests save
        those blocks again as they recompute them; its saves are forgotten."""
        if meta is not None:
            for _, h in meta.loads:
                self.available.discard(h)
            for _, h in meta.saves:
                self.pending.discard(h)
        for rid, first in self.first_loaded_block.items():
            if rid in self._saved_upto:
                self._saved_upto[rid] = min(self._saved_upto[rid], first)
        self.first_loaded_block.clear()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        """(whether the request's blocks must outlive it, what a peer needs
        to fetch them): an offload tier copies them out as they fill, so
        neither."""
        self._saved_upto.pop(request.request_id, None)
        return False, None
