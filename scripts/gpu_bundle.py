"""The wheels a GPU machine needs beyond its image, and the check that they suffice.

    python3 scripts/gpu_bundle.py build DIR     (here, with the network)
    python3 scripts/gpu_bundle.py verify SITE [--image FILE --python-version 3.12]

``build`` fills DIR with CPython 3.12 manylinux x86_64 wheels of every runtime
dependency of the project that the image (``scripts/gpu_image.txt``) lacks,
the project's own wheel and antlr4-python3-runtime built into one (it has
none on PyPI): pip resolves the project's requirements for that platform
without installing anything (``--dry-run --report``), the closure is walked
from the project's requirements and stops at packages the image holds, and
what is left is downloaded. It refuses a bundle over 64 MiB.

``verify`` walks the installed project's requirements (and theirs) and
reports each one that is missing or of a version outside its specifier.
Distributions are looked up in SITE first, then in the running
interpreter's environment (on the GPU machine: the image), or, with
``--image``, in that list instead (a rehearsal on another machine: bare
names count as present at any version). Exit status 1 when anything is
missing. Standard library and ``packaging`` only.
"""

from __future__ import annotations

import argparse
import email.parser
import glob
import os
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
IMAGE = os.path.join(HERE, "gpu_image.txt")
PROJECT = "appliance"
LIMIT_BYTES = 64 << 20
PYTHON = "3.12"
# pip matches manylinux tags exactly: every one the CPython 3.12 wheels we need are published under
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64"]
SDIST_ONLY = ["antlr4-python3-runtime==4.9.3"]  # omegaconf 2.3's pin; PyPI has no wheel of it


def target_flags(python: str = PYTHON) -> list[str]:
    """pip options that pick wheels for CPython ``python`` on manylinux x86_64, whatever runs pip."""
    flags = ["--python-version", python, "--implementation", "cp", "--abi", "cp" + python.replace(".", ""),
             "--only-binary=:all:"]
    for p in PLATFORMS:
        flags += ["--platform", p]
    return flags


def read_image(path: str) -> dict[str, str | None]:
    """{canonical name: version or None} of the image's package list."""
    out: dict[str, str | None] = {}
    for line in open(path):
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canonicalize_name(name)] = version or None
    return out


def marker_env(python: str) -> dict[str, str]:
    env = default_environment()
    env.update(python_version=python, python_full_version=python + ".0", sys_platform="linux",
               platform_system="Linux", platform_machine="x86_64", os_name="posix",
               implementation_name="cpython", platform_python_implementation="CPython")
    return env


def applies(req: Requirement, env: dict[str, str], extras: frozenset[str] = frozenset()) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**env, "extra": e}) for e in (extras or {""}))


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], check=True)


def wheel_requires(path: str) -> tuple[str, list[str]]:
    """(canonical name, Requires-Dist lines) from a wheel's METADATA."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        msg = email.parser.BytesParser().parsebytes(z.read(meta))
    return canonicalize_name(msg["Name"]), msg.get_all("Requires-Dist") or []


def build(dest: str, image_path: str) -> int:
    """Breadth first from the project's requirements: download (without their dependencies) the wheels of
    every requirement the image does not hold, read their requirements, repeat; then check the whole with
    ``verify`` against the image's list."""
    os.makedirs(dest, exist_ok=True)
    for old in glob.glob(os.path.join(dest, "*.whl")):
        os.remove(old)
    pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", dest, ROOT)
    image = read_image(image_path)
    env = marker_env(PYTHON)
    sdists = {canonicalize_name(Requirement(s).name): s for s in SDIST_ONLY}
    have: set[str] = set()
    wanted: dict[str, list[Requirement]] = {}

    def scan() -> None:
        for w in glob.glob(os.path.join(dest, "*.whl")):
            name, lines = wheel_requires(w)
            if name in have:
                continue
            have.add(name)
            for line in lines:
                req = Requirement(line)
                dep = canonicalize_name(req.name)
                if applies(req, env) and dep not in image:
                    wanted.setdefault(dep, []).append(req)

    scan()
    while missing := sorted(set(wanted) - have):
        local = [sdists[n] for n in missing if n in sdists]
        if local:
            pip("wheel", "-q", "--no-deps", "-w", dest, *local)
        remote = []
        for n in missing:
            if n not in sdists:
                spec = SpecifierSet()
                for r in wanted[n]:
                    spec &= r.specifier
                remote.append(f"{n}{spec}")
        if remote:
            pip("download", "-q", "--no-deps", "-d", dest, *target_flags(), *remote)
        scan()
    wheels = sorted(glob.glob(os.path.join(dest, "*.whl")))
    size = sum(os.path.getsize(w) for w in wheels)
    for w in wheels:
        print(f"{os.path.getsize(w) / 2**20:7.2f} MiB  {os.path.basename(w)}")
    print(f"{size / 2**20:7.2f} MiB in {len(wheels)} wheels (limit {LIMIT_BYTES >> 20} MiB)")
    if size > LIMIT_BYTES:
        print("the bundle is larger than what can travel to the GPU machine", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as site:  # the rehearsal of the GPU machine's install
        install_bundle(dest, site, PYTHON)
        return verify(site, image_path, PYTHON)


def install_bundle(bundle: str, site: str, python: str | None = None) -> None:
    """Unpack every wheel of ``bundle`` into ``site`` with no network (for another Python: ``python``)."""
    flags = target_flags(python) if python else []
    pip("install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade", *flags,
        "--target", site, *sorted(glob.glob(os.path.join(bundle, "*.whl"))))


def installed(site: str, image_path: str | None) -> dict[str, tuple[str | None, list[str]]]:
    """{canonical name: (version or None, Requires-Dist)} visible to the check."""
    found: dict[str, tuple[str | None, list[str]]] = {}
    if image_path:
        found.update({n: (v, []) for n, v in read_image(image_path).items()})
        paths = [site]
    else:
        paths = [site] + sys.path
    for dist in reversed(list(metadata.distributions(path=paths))):  # the first on the path wins
        found[canonicalize_name(dist.metadata["Name"])] = (dist.version, dist.requires or [])
    return found


def verify(site: str, image_path: str | None, python: str) -> int:
    found = installed(site, image_path)
    env = marker_env(python)
    if PROJECT not in found:
        print(f"{PROJECT} is not installed in {site}")
        return 1
    problems, seen, todo = [], set(), [(PROJECT, frozenset())]
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        for line in found[name][1]:
            req = Requirement(line)
            if not applies(req, env, extras):
                continue
            dep = canonicalize_name(req.name)
            if dep not in found:
                problems.append(f"{dep} (needed by {name}: {line}) is missing")
                continue
            version = found[dep][0]
            if version is not None and req.specifier and not req.specifier.contains(Version(version),
                                                                                   prereleases=True):
                problems.append(f"{dep} {version} does not satisfy {name}'s {line}")
            todo.append((dep, frozenset(req.extras)))
    for p in sorted(set(problems)):
        print(p)
    print(f"{len({n for n, _ in seen})} distributions checked, {len(set(problems))} problems")
    return 1 if problems else 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="fill DIR with the wheels the GPU machine lacks")
    b.add_argument("dir")
    b.add_argument("--image", default=IMAGE)
    v = sub.add_parser("verify", help="check the installed project's requirements are all present")
    v.add_argument("site")
    v.add_argument("--image", default=None, help="the image's package list (default: this interpreter's packages)")
    v.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}")
    args = ap.parse_args(argv)
    if args.cmd == "build":
        return build(args.dir, args.image)
    return verify(args.site, args.image, args.python_version)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
