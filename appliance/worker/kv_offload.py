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
unreadable. A file holds one block of every layer: a small JSON header
(the payload's shape and dtype, checked on load) then the layers' K and V,
``[layers, 2, block_size, kv_heads, head_dim]`` in the cache dtype.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import struct
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Optional

import torch

from appliance.engine.kv_connector import BLOCK_SUFFIX, KVConnectorOutput, OffloadMetadata, stored_hashes
from appliance.worker.kv_connector import KVConnectorWorker

log = logging.getLogger("appliance.kv_offload")

MAGIC = b"APKV1\0"


class KVLoadError(RuntimeError):
    """A tier file could not be read into the pool (missing, truncated, another
    layout). It left the tier; the step's requests are not to blame and run
    again (``retry_requests``), recomputing what the file held."""

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
        self._copying: list[tuple[bytes, torch.Tensor, object]] = []  # (hash, block, CUDA event or None)
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
    """A rank's tier folder (see the module docstring); ``agree`` as ``_Tier``'s."""

    def __init__(self, folder: Path, max_bytes: int, agree: Optional[Callable[[bool], bool]] = None):
        self.folder, self.max_bytes, self.agree, self._layers = Path(folder), max_bytes, agree, []
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
        self._lock = threading.Lock()
        self._writer = threading.Thread(target=self._write_loop, name="kv-offload-writer", daemon=True)
        self._writer.start()

    def _path(self, h: bytes) -> Path:
        return self.folder / (h.hex() + BLOCK_SUFFIX)

    @staticmethod
    def _header(block: torch.Tensor) -> bytes:
        meta = json.dumps({"shape": list(block.shape), "dtype": str(block.dtype).removeprefix("torch.")}).encode()
        return MAGIC + struct.pack("<I", len(meta)) + meta

    # -- before the forward ------------------------------------------------------
    def _load(self, meta: OffloadMetadata, kv_caches: list[torch.Tensor]) -> None:
        like = torch.stack([c[:, 0] for c in kv_caches])  # one block's shape and dtype
        expected = self._header(like)
        nbytes = like.numel() * like.element_size()
        for block_id, h in meta.loads:
            path = self._path(h)
            try:
                raw = path.read_bytes()
            except OSError as e:
                self._drop(h)
                raise KVLoadError(f"KV tier block {h.hex()[:16]} cannot be read: {e}") from e
            if raw[: len(expected)] != expected or len(raw) != len(expected) + nbytes:
                self._drop(h)
                raise KVLoadError(f"KV tier block {h.hex()[:16]} is not a whole block of this layout "
                                  f"({len(raw)} bytes)")
            block = torch.frombuffer(bytearray(raw[len(expected):]), dtype=like.dtype).view(like.shape)
            for layer, cache in enumerate(kv_caches):
                cache[:, block_id].copy_(block[layer])
            try:
                os.utime(path)  # recently used: survives eviction longest, across restarts too
            except OSError:
                pass
            with self._lock:
                if h in self._lru:
                    self._lru.move_to_end(h)

    # -- after the forward ---------------------------------------------------------
    def _keep(self, h: bytes, block: torch.Tensor) -> None:
        """One saved block, written in the background."""
        self._queue.put((h, block.cpu().contiguous()))

    def get_finished(self) -> KVConnectorOutput:
        """The writes completed since the last call, and the files dropped:
        past the size limit (least recently used first) or unreadable."""
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
        return KVConnectorOutput(saved=[h for h in saved if h in self._lru], dropped=dropped)

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
                data = self._header(block) + block.view(torch.uint8).numpy().tobytes()
                tmp.write_bytes(data)
                os.replace(tmp, path)
                with self._lock:
                    self._done.append((h, len(data)))
            except Exception:  # a full disk loses this block from the tier, nothing else
                log.exception("writing KV block %s to the offload tier failed", h.hex()[:16])
            finally:
                self._queue.task_done()
