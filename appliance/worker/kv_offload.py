"""The offload tier's worker side (``kv_transfer.connector=offload``; the
scheduler side and the file layout: ``engine/kv_connector.py``): a folder
on disk (``OffloadWorker``, below) or host memory (``HostTierWorker``, the
same calls, the blocks kept as tensors).

Around a step's forward the model runner calls ``start_load_kv`` (the
step's loads, read from their files into the blocks the scheduler gave
them, before any layer runs), ``save_kv_layer`` as each layer has written
its K and V (that layer's part of the step's saves, copied out), and
``wait_for_save`` (the blocks, every layer's parts together, written by a
background thread: each to a temporary name, then renamed, so a file is
whole or absent), then ``get_finished`` for the step's ``KVConnectorOutput``: the writes that
completed, and the files dropped to keep the tier under its size limit
(least recently used first; a load refreshes a file's use) or found
unreadable. A file holds one block of every layer: a small JSON header,
then the layers' K and V, ``[layers, 2, block_size, kv_heads, head_dim]``
in the cache dtype. The header says what the payload belongs to (its
block hash, the tier it was written for: the model and KV layout's key
with its core and rank folders, and the payload's shape and dtype) and
carries the payload's SHA-256 (``kv_digest``); a load checks all of them
before the bytes enter the cache, so a file damaged on disk, another
block's file under this one's name or another tier's file copied in is a
miss (removed, counted, its block recomputed), never wrong tokens.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import struct
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

from appliance.engine.kv_connector import BLOCK_SUFFIX, KVConnectorOutput, OffloadMetadata, stored_hashes
from appliance.worker.kv_checksum import dtype_name, kv_digest
from appliance.worker.kv_connector import KVConnectorWorker

log = logging.getLogger("appliance.kv_offload")

# the tier file format: version 2's header names the block and the tier and carries the payload's SHA-256;
# a file of another version (or no tier file at all) is unreadable
MAGIC = b"APKV2\0"
PAYLOAD_ALIGN = 64  # the header is padded so that the payload starts at a multiple of this
MAX_READERS = 8  # threads reading and checking a step's loads (at most the torch threads: this rank's cores)


class KVLoadError(RuntimeError):
    """A tier file could not be read into the pool (missing, truncated, damaged,
    another block's, tier's or format version's). It left the tier; the
    step's requests are not to blame and run again (``retry_requests``),
    recomputing what the file held."""

    retry_requests = True


class _Tier(KVConnectorWorker):
    """What both tiers share: loads with the stage's ranks agreeing on
    failures, and saves a layer at a time. ``agree(failed)``: with
    tensor-parallel ranks, whether any rank of this one's pipeline stage
    failed its loads of the step (an all-reduce), so that all of them fail
    the step or none does."""

    agree: Optional[Callable[[bool], bool]] = None
    _layers: list[torch.Tensor]  # this step's saves so far: each layer's part of the blocks (as bytes)
    _save_ids: Optional[torch.Tensor] = None  # this step's saved block ids, on the caches' device

    def start_load_kv(self, meta: Optional[OffloadMetadata], kv_caches: list[torch.Tensor]) -> None:
        """The step's loads into their blocks of every layer's cache; a block
        that cannot be read raises KVLoadError (the step fails, its requests
        are recomputed) and leaves the tier. When another rank of the stage
        could not read its part (``agree``), this rank raises KVLoadError
        too, so the ranks fail the step together."""
        self.meta, self._layers, self._save_ids = meta, [], None
        if meta is None or not meta.loads:
            return
        failed = None
        try:
            self._load(meta, kv_caches)
        except KVLoadError as e:
            failed = e
        if self.agree is not None and self.agree(failed is not None) and failed is None:
            raise KVLoadError("another rank could not read its part of a KV tier block of this step")
        if failed is not None:
            raise failed

    def _load(self, meta: OffloadMetadata, kv_caches: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def save_kv_layer(self, layer: int, kv_cache: torch.Tensor) -> None:
        """This layer's part of the step's saves, copied out now (as bytes: any cache dtype)."""
        meta = self.meta
        if meta is None or not meta.saves:
            return
        if self._save_ids is None:  # once per step: every layer's cache is on one device
            self._save_ids = torch.tensor([b for b, _ in meta.saves], dtype=torch.long, device=kv_cache.device)
        self._layers.append(kv_cache.view(torch.uint8).index_select(1, self._save_ids))  # [2, blocks, ...]
        self._dtype = kv_cache.dtype

    def wait_for_save(self) -> None:
        """The step's saves, each block of every layer, handed to the tier."""
        layers, self._layers = self._layers, []
        if not layers:
            return
        blocks = torch.stack(layers).movedim(2, 0)  # [blocks, layers, 2, ...] as bytes
        for (_, h), block in zip(self.meta.saves, blocks):
            self._keep(h, block.contiguous().view(self._dtype))

    def _keep(self, h: bytes, block: torch.Tensor) -> None:
        """Put one saved block (every layer's K and V) into the tier."""
        raise NotImplementedError


class HostTierWorker(_Tier):
    """A rank's tier in host memory (``kv_transfer.offload.medium=host``):
    each saved block one tensor of every layer's K and V, in pinned memory
    when the caches are on a GPU (copied out without blocking the step, and
    reported saved once the copy is done), least recently used dropped past
    ``max_bytes``; gone with the process."""

    def __init__(self, max_bytes: int, agree: Optional[Callable[[bool], bool]] = None):
        self.max_bytes, self.agree, self._layers = max_bytes, agree, []
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._copying: list[tuple[bytes, torch.Tensor, Any]] = []  # (hash, block, CUDA event or None)
        self._dropped: list[bytes] = []

    def _load(self, meta: OffloadMetadata, kv_caches: list[torch.Tensor]) -> None:
        for block_id, h in meta.loads:
            block = self._blocks.get(h)
            if block is None:  # dropped since the scheduler was told it was here
                self._dropped.append(h)
                raise KVLoadError(f"KV tier block {h.hex()[:16]} is no longer in host memory")
            self._blocks.move_to_end(h)
            for layer, cache in enumerate(kv_caches):
                cache[:, block_id].copy_(block[layer], non_blocking=True)

    def _keep(self, h: bytes, src: torch.Tensor) -> None:
        """One saved block copied to host memory (on a GPU: pinned, without waiting for the copy)."""
        gpu = src.is_cuda
        block = torch.empty(src.shape, dtype=src.dtype, pin_memory=gpu)
        block.copy_(src, non_blocking=gpu)
        event = None
        if gpu:
            event = torch.cuda.Event()
            event.record()
        self._copying.append((h, block, event))

    def get_finished(self) -> KVConnectorOutput:
        """The blocks whose copies completed since the last call, and those
        dropped: past the size limit (least recently used first) or missing."""
        saved, copying = [], []
        for h, block, event in self._copying:
            if event is not None and not event.query():
                copying.append((h, block, event))
                continue
            self._bytes += block.numel() * block.element_size()
            old = self._blocks.pop(h, None)
            if old is not None:
                self._bytes -= old.numel() * old.element_size()
            self._blocks[h] = block
            saved.append(h)
        self._copying = copying
        dropped, self._dropped = [h for h in self._dropped if h not in saved], []  # a block saved again since stays
        while self._bytes > self.max_bytes and self._blocks:
            h, block = self._blocks.popitem(last=False)
            self._bytes -= block.numel() * block.element_size()
            dropped.append(h)
        return KVConnectorOutput(saved=[h for h in saved if h in self._blocks], dropped=dropped)

    def flush(self) -> None:
        """Wait until every block's copy is done (tests, shutdown)."""
        for _, _, event in self._copying:
            if event is not None:
                event.synchronize()


class OffloadWorker(_Tier):
    """A rank's tier folder (see the module docstring); ``identity``: the
    tier part it holds, written into every file's header and checked on
    load (``engine.kv_connector.tier_identity``); ``agree`` as ``_Tier``'s."""

    def __init__(self, folder: Path, identity: str, max_bytes: int,
                 agree: Optional[Callable[[bool], bool]] = None):
        self.folder, self.identity, self.max_bytes, self.agree = Path(folder), identity, max_bytes, agree
        self._layers = []
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lru: OrderedDict[bytes, int] = OrderedDict()  # hash -> file bytes, least recently used first
        for h in stored_hashes(self.folder):
            try:
                self._lru[h] = self._path(h).stat().st_size
            except OSError:
                continue
        self._bytes = sum(self._lru.values())
        self._queue: queue.Queue = queue.Queue()
        self._done: list[tuple[bytes, int]] = []  # written since the last report
        self._dropped: list[bytes] = []
        self._corrupt = 0  # files that failed their checks on load since the last report
        self._lock = threading.Lock()
        # the step's loads read and checked in parallel (file reads and SHA-256 release the GIL)
        readers = max(1, min(MAX_READERS, torch.get_num_threads()))
        self._readers = ThreadPoolExecutor(readers, thread_name_prefix="kv-offload-reader")
        self._window = 2 * readers
        self._writer = threading.Thread(target=self._write_loop, name="kv-offload-writer", daemon=True)
        self._writer.start()

    def _path(self, h: bytes) -> Path:
        return self.folder / (h.hex() + BLOCK_SUFFIX)

    def _header(self, h: bytes, block: torch.Tensor) -> bytes:
        """Block ``h``'s file header: what its payload ``block`` belongs to
        and its checksum, padded so that the payload starts aligned."""
        meta = json.dumps({"block": h.hex(), "tier": self.identity, "shape": list(block.shape),
                           "dtype": dtype_name(block.dtype), "sha256": kv_digest(block)}).encode()
        size = len(MAGIC) + 4 + len(meta)
        meta += b" " * (-size % PAYLOAD_ALIGN)
        return MAGIC + struct.pack("<I", len(meta)) + meta

    # -- before the forward ------------------------------------------------------
    def _load(self, meta: OffloadMetadata, kv_caches: list[torch.Tensor]) -> None:
        """The step's loads read and checked by the reader threads (a window of
        loads at a time, so that a window's blocks are all it holds), each
        copied here into its block of every layer once checked. After a
        load that fails the rest are still checked (not copied: the step
        fails), so every damaged file of the step leaves the tier at once."""
        shape, dtype = [len(kv_caches), *kv_caches[0][:, 0].shape], kv_caches[0].dtype  # one block's
        failed: Optional[KVLoadError] = None
        for start in range(0, len(meta.loads), self._window):
            loads = meta.loads[start : start + self._window]
            checked = self._readers.map(lambda load: self._checked(load[1], shape, dtype), loads)
            for (block_id, h), block in zip(loads, checked):
                if isinstance(block, KVLoadError):
                    failed = failed or block
                elif failed is None:
                    self._copy_in(h, block, block_id, kv_caches)
        if failed is not None:
            raise failed

    def _copy_in(self, h: bytes, block: torch.Tensor, block_id: int, kv_caches: list[torch.Tensor]) -> None:
        """Checked block ``h`` into block ``block_id`` of every layer's cache; its file used most recently."""
        for layer, cache in enumerate(kv_caches):
            cache[:, block_id].copy_(block[layer])
        try:
            os.utime(self._path(h))  # recently used: survives eviction longest, across restarts too
        except OSError:
            pass
        with self._lock:
            if h in self._lru:
                self._lru.move_to_end(h)

    def _checked(self, h: bytes, shape: list[int], dtype: torch.dtype) -> Union[torch.Tensor, KVLoadError]:
        """``_read``'s block, or its error."""
        try:
            return self._read(h, shape, dtype)
        except KVLoadError as e:
            return e

    def _read(self, h: bytes, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        """Block ``h``'s payload from its file, once the header says it is this
        tier's block ``h`` of ``shape`` and ``dtype`` and the payload matches
        its checksum; else the file is rejected and KVLoadError raised."""
        path = self._path(h)
        try:
            with open(path, "rb") as f:
                raw = bytearray(os.fstat(f.fileno()).st_size)
                size = f.readinto(raw)
        except OSError as e:
            self._drop(h)
            raise KVLoadError(f"KV tier block {h.hex()[:16]} cannot be read: {e}") from e
        start = len(MAGIC) + 4
        if size < start or raw[: len(MAGIC)] != MAGIC:
            raise self._reject(h, "it is not a tier file of this format version")
        (meta_len,) = struct.unpack_from("<I", raw, len(MAGIC))
        try:
            header = json.loads(raw[start : start + meta_len])
        except ValueError:
            header = None
        if not isinstance(header, dict):
            raise self._reject(h, "its header is unreadable")
        if header.get("block") != h.hex():
            raise self._reject(h, "its header names another block")
        if header.get("tier") != self.identity:
            raise self._reject(h, f"it was written for another model or KV layout (tier {header.get('tier')!r}, "
                                  f"this is {self.identity!r})")
        if header.get("shape") != shape or header.get("dtype") != dtype_name(dtype):
            raise self._reject(h, f"its payload is {header.get('dtype')} {header.get('shape')}, this layout's "
                                  f"{dtype_name(dtype)} {shape}")
        payload = memoryview(raw)[start + meta_len : size]
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if len(payload) != nbytes:
            raise self._reject(h, f"its payload is {len(payload)} bytes, a block is {nbytes}")
        if kv_digest(payload) != header.get("sha256"):
            raise self._reject(h, "its payload does not match its checksum")
        return torch.frombuffer(raw, dtype=dtype, offset=start + meta_len, count=nbytes // dtype.itemsize).view(shape)

    def _reject(self, h: bytes, why: str) -> KVLoadError:
        """Block ``h``'s file failed a check on load (``why``): logged, counted
        and removed from the tier; the error to raise (the block is recomputed)."""
        log.warning("offload tier file %s rejected: %s; removed, its block is recomputed", self._path(h), why)
        with self._lock:
            self._corrupt += 1
        self._drop(h)
        return KVLoadError(f"KV tier block {h.hex()[:16]} rejected: {why}")

    # -- after the forward ---------------------------------------------------------
    def _keep(self, h: bytes, block: torch.Tensor) -> None:
        """One saved block, written in the background."""
        self._queue.put((h, block.cpu().contiguous()))

    def get_finished(self) -> KVConnectorOutput:
        """The writes completed since the last call, and the files dropped:
        past the size limit (least recently used first) or unreadable (and
        how many of those failed their checks)."""
        with self._lock:
            done, self._done = self._done, []
            dropped, self._dropped = self._dropped, []
        saved = []
        for h, size in done:
            self._bytes += size - self._lru.pop(h, 0)
            self._lru[h] = size
            saved.append(h)
        dropped = [h for h in dropped if h not in saved]  # a block written again since it was dropped stays
        while self._bytes > self.max_bytes and self._lru:
            h, size = self._lru.popitem(last=False)
            self._bytes -= size
            try:
                self._path(h).unlink()
            except FileNotFoundError:
                pass
            dropped.append(h)
        with self._lock:
            corrupt, self._corrupt = self._corrupt, 0
        return KVConnectorOutput(saved=[h for h in saved if h in self._lru], dropped=dropped, corrupt=corrupt)

    def _drop(self, h: bytes) -> None:
        with self._lock:
            self._bytes -= self._lru.pop(h, 0)
            self._dropped.append(h)
        try:
            self._path(h).unlink()
        except FileNotFoundError:
            pass

    def flush(self) -> None:
        """Wait until every queued block is written (tests, shutdown)."""
        self._queue.join()

    def _write_loop(self) -> None:
        while True:
            h, block = self._queue.get()
            try:
                path = self._path(h)
                tmp = path.with_name(path.name + f".tmp{threading.get_ident()}")
                header, payload = self._header(h, block), block.view(torch.uint8).numpy()
                with open(tmp, "wb") as f:
                    f.write(header)
                    f.write(payload)
                os.replace(tmp, path)
                with self._lock:
                    self._done.append((h, len(header) + payload.nbytes))
            except Exception:  # a full disk loses this block from the tier, nothing else
                log.exception("writing KV block %s to the offload tier failed", h.hex()[:16])
            finally:
                self._queue.task_done()
