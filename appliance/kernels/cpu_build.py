"""Build (or find) the native CPU libraries, without loading them.

``build_library()`` returns the path of ``cpu_ops-<hash>.so`` (the AVX2
kernels), ``build_shm_comm()`` that of ``shm_comm-<hash>.so`` (collectives
between ranks over shared memory, portable C): prebuilt in
``$APPLIANCE_KERNEL_DIR`` (images ship them there), cached under
``$APPLIANCE_CACHE_DIR/kernels``, or compiled now with the system's C
compiler. Failures raise ImportError with the reason, which the backend
selector reports. ``python -m appliance.kernels.cpu_build`` compiles both
into the cache without checking this machine's CPU (image builds).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.c"
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]
SHM_SOURCE = Path(__file__).parent / "csrc" / "shm_comm.c"
SHM_CFLAGS = ["-O2", "-fPIC", "-shared", "-std=gnu11"]
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cache_root() -> Path:
    root = os.environ.get("APPLIANCE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "appliance")
    return Path(root) / "kernels"


def library_name(source: Path = SOURCE, flags: list[str] = CFLAGS) -> str:
    """A library's file name: one per source and flags."""
    key = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    return f"{source.stem}-{key}.so"


def build_library(check_cpu: bool = True) -> Path:
    """The kernels' path: prebuilt in $APPLIANCE_KERNEL_DIR, cached, or compiled
    now (once per source/flags hash) into the cache."""
    missing = [f for f in REQUIRED_CPU_FLAGS if f not in _cpu_flags()] if check_cpu else []
    if missing:
        raise ImportError(f"cpu_native needs a CPU with {', '.join(REQUIRED_CPU_FLAGS)}; this one lacks {', '.join(missing)}")
    return _build(SOURCE, CFLAGS, "cpu_native")


def build_shm_comm() -> Path:
    """The shared-memory collectives' path (any CPU; a C compiler where not prebuilt)."""
    return _build(SHM_SOURCE, SHM_CFLAGS, "shm_comm")


def _build(source: Path, flags: list[str], what: str) -> Path:
    """``what``: the library's name in messages."""
    name = library_name(source, flags)
    prebuilt = os.environ.get("APPLIANCE_KERNEL_DIR")
    if prebuilt and (Path(prebuilt) / name).exists():  # shipped with an image, no compiler needed
        return Path(prebuilt) / name
    out = _cache_root() / name
    if out.exists():
        return out
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise ImportError(f"{what} needs a C compiler (gcc) to build its kernels; none on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        try:
            proc = subprocess.run([cc, *flags, "-o", tmp, str(source), "-lm"], capture_output=True, text=True)
        except OSError as e:
            raise ImportError(f"building {what} kernels with {cc} failed: {e}") from e
        if proc.returncode != 0:
            raise ImportError(f"building {what} kernels with {cc} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)  # atomic: concurrent builders agree on the result
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


if __name__ == "__main__":
    print(build_library(check_cpu=False))
    print(build_shm_comm())
    sys.exit(0)
