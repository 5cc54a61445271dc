"""Collectives between tensor-parallel ranks on one host, over shared memory.

A decode step of a tensor-parallel model runs two all-reduces per layer on
a few kilobytes each: over gloo (loopback TCP) each costs about a
millisecond on a small CPU host, over shared memory a few microseconds
(``csrc/shm_comm.c``: a flag line per rank and double-buffered slots, see
there). ``ShmComm`` has the collectives' interface the model runs
(``all_reduce`` in place, ``all_gather`` in rank order, ``broadcast`` from
one rank into the others' tensors) and gives every rank the same bits (the
sum is taken in rank order on each).

The executor creates the segment (``create_segment``) before it starts the
ranks, each rank maps it (``ShmComm``), and the executor unlinks the file
once they all have (the mapping outlives the name).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
import uuid

import torch

from appliance.kernels.cpu_build import build_shm_comm

_LIB = ctypes.CDLL(str(build_shm_comm()))
_p, _i64 = ctypes.c_void_p, ctypes.c_int64
_LIB.appl_shm_all_reduce.argtypes = [_p, ctypes.c_int, ctypes.c_int, _i64, ctypes.POINTER(ctypes.c_uint64), _p, _i64,
                                     ctypes.c_int, _i64]
_LIB.appl_shm_all_reduce.restype = ctypes.c_int
_LIB.appl_shm_all_gather.argtypes = [_p, ctypes.c_int, ctypes.c_int, _i64, ctypes.POINTER(ctypes.c_uint64), _p, _i64,
                                     _p, _i64]
_LIB.appl_shm_all_gather.restype = ctypes.c_int
_LIB.appl_shm_broadcast.argtypes = [_p, ctypes.c_int, ctypes.c_int, _i64, ctypes.POINTER(ctypes.c_uint64), _p, _i64,
                                    ctypes.c_int, _i64]
_LIB.appl_shm_broadcast.restype = ctypes.c_int



class ShmReduceCtx(ctypes.Structure):
    """``ShmReduceCtx`` in csrc/shm_comm.c."""

    _fields_ = [("segment", _p), ("rank", ctypes.c_int32), ("world", ctypes.c_int32), ("cap", _i64),
                ("timeout_ns", _i64), ("seq", ctypes.POINTER(ctypes.c_uint64))]


LINE = 64
SLOT_BYTES = 4 << 20  # per rank and parity; longer inputs go through in chunks
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def segment_bytes(world_size: int, slot_bytes: int = SLOT_BYTES) -> int:
    return world_size * LINE + 2 * world_size * slot_bytes


def create_segment(world_size: int, slot_bytes: int = SLOT_BYTES) -> str:
    """A new zero-filled segment file for ``world_size`` ranks (in /dev/shm
    where there is one); its path."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(folder, f"appliance-tp-{uuid.uuid4().hex}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, segment_bytes(world_size, slot_bytes))
    finally:
        os.close(fd)
    return path


class ShmComm:
    """Rank ``rank`` of ``world_size`` on the segment at ``path``; a collective
    waits at most ``timeout_s`` for the other ranks (then RuntimeError)."""

    def __init__(self, path: str, rank: int, world_size: int, timeout_s: float, slot_bytes: int = SLOT_BYTES):
        self.rank, self.world_size, self.slot_bytes = rank, world_size, slot_bytes
        self.timeout_ns = int(timeout_s * 1e9)
        fd = os.open(path, os.O_RDWR)
        try:
            size = segment_bytes(world_size, slot_bytes)
            if os.fstat(fd).st_size != size:
                raise ValueError(f"shared-memory segment {path} holds {os.fstat(fd).st_size} bytes, not {size}")
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._seq = ctypes.c_uint64(0)  # operations so far: every rank runs them in one order

    def _check(self, rc: int, what: str) -> None:
        if rc:
            raise RuntimeError(f"shared-memory {what} on rank {self.rank}: the other ranks did not arrive within "
                               f"{self.timeout_ns / 1e9:g} s")

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum ``t`` (fp32 or bf16, on the CPU) over the ranks, in place."""
        if t.dtype not in _DTYPES or t.device.type != "cpu":
            raise ValueError(f"shared-memory all-reduce takes fp32 or bf16 CPU tensors, not {t.dtype} on {t.device}")
        buf = t if t.is_contiguous() else t.contiguous()
        rc = _LIB.appl_shm_all_reduce(self._base, self.rank, self.world_size, self.slot_bytes, ctypes.byref(self._seq),
                                      buf.data_ptr(), buf.numel(), _DTYPES[t.dtype], self.timeout_ns)
        self._check(rc, "all-reduce")
        if buf is not t:
            t.copy_(buf)

    def native_reduce(self) -> tuple[int, int, "ShmReduceCtx"]:
        """(address of the C fp32 all-reduce, address of its context, the
        context) for native code that reduces through this rank's segment
        in line with its Python collectives; keep the context alive while
        the addresses are in use."""
        ctx = ShmReduceCtx(self._base, self.rank, self.world_size, self.slot_bytes, self.timeout_ns,
                           ctypes.pointer(self._seq))
        fn = ctypes.cast(_LIB.appl_shm_reduce_f32, _p).value
        assert fn is not None  # the library exports it
        return fn, ctypes.addressof(ctx), ctx

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (same shape and dtype on each), in rank order."""
        if t.device.type != "cpu":
            raise ValueError(f"shared-memory all-gather takes CPU tensors, not {t.device}")
        t = t.contiguous()
        out = torch.empty((self.world_size, *t.shape), dtype=t.dtype)
        nbytes = t.numel() * t.element_size()
        rc = _LIB.appl_shm_all_gather(self._base, self.rank, self.world_size, self.slot_bytes, ctypes.byref(self._seq),
                                      t.data_ptr(), nbytes, out.data_ptr(), self.timeout_ns)
        self._check(rc, "all-gather")
        return list(out.unbind(0))

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        """``src``'s ``t`` into every other rank's ``t`` (same shape and dtype on each), in place."""
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("shared-memory broadcast takes contiguous CPU tensors")
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast source {src} outside 0..{self.world_size - 1}")
        rc = _LIB.appl_shm_broadcast(self._base, self.rank, self.world_size, self.slot_bytes, ctypes.byref(self._seq),
                                     t.data_ptr(), t.numel() * t.element_size(), src, self.timeout_ns)
        self._check(rc, "broadcast")
