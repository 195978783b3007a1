"""The wheels lit_smd needs on the lent GPU machine beyond its image: download them here, install them there.

The GPU machine (`nvidia-h200`) has no network. Its image holds torch 2.11, transformers 5.17, lightning, torchmetrics,
pandas, pyarrow, peft, ... (`IMAGE`, as listed for that machine), but lit_smd needs transformers >= 5.24 and datasets,
jsonargparse and math-verify, which the image lacks. So:

1. here (network to PyPI), from the repository root::

       python benchmarks/gpu_wheels.py download            # -> .whl/ (git-ignored), about 20 MB

   resolves lit_smd's requirements (``pyproject.toml``) for CPython 3.12 on manylinux x86_64, one ``pip download
   --no-deps`` per distribution, following each wheel's ``Requires-Dist``: a distribution the image holds in a
   version that satisfies every requirement on it is not carried; one the image holds in an unknown version is
   carried when its wheel is small (at most ``--insure-mib``, so the installer can use it should the image's be too
   old); `SKIP` lists what is deliberately left out. Where the running environment (the one the test suite uses)
   has a distribution in a version that satisfies the requirements, that version is downloaded: the machine runs
   what the tests ran. ``.whl/needs.txt`` records, per wheel, the requirement it serves.

2. there, before anything imports transformers (`benchmarks/gpu_check.sh` does this)::

       python3 benchmarks/gpu_wheels.py install --wheels .whl --target /tmp/site
       export PYTHONPATH=/tmp/site:$PYTHONPATH

   installs (``pip install --no-index --no-deps --target``) each carried wheel whose distribution is missing there or
   whose installed version misses the requirement in ``needs.txt``, then lists any of lit_smd's requirements still
   unmet. It exits non-zero only when transformers is unmet (nothing can run).
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib  # Python >= 3.11 (here and on the GPU machine's 3.12)
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]

IMAGE: dict[str, str | None] = {
    **dict.fromkeys(
        "absl-py accelerate aiohttp aiosignal anyio attrs certifi charset-normalizer click filelock frozenlist fsspec "
        "grpcio h11 hf-xet httpcore httpx idna jinja2 lightning lightning-utilities markdown markdown-it-py markupsafe "
        "mdurl mpmath multidict networkx packaging pandas peft pillow pip protobuf psutil pyarrow pygments "
        "python-dateutil pytorch-lightning pyyaml regex requests rich scipy setuptools shellingham six sympy "
        "tensorboard tensorboard-data-server tqdm typer typing-extensions urllib3 werkzeug wheel xxhash yarl "
        "zipp".split()
    ),
    "huggingface-hub": "1.33.0", "numpy": "2.5.2", "safetensors": "0.8.0", "tokenizers": "0.23.2",
    "torch": "2.11.0", "torchmetrics": "1.9.0", "transformers": "5.17.0", "triton": "3.6.0",
}  # fmt: skip
"""Distributions of the GPU machine's image (``.library/device/KINDS.md``, read 2026-11-17), with the version where
it was listed (None: present, version not listed)."""

SKIP = {
    "bitsandbytes": "8-/4-bit quantized loading only (~60 MB of CUDA binaries); the GPU check loads no quantized model",
}
"""Requirements of lit_smd deliberately not carried, with the reason."""

TARGET = {
    "python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux",
    "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}  # fmt: skip
"""The GPU machine's interpreter, for evaluating environment markers."""

PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_24_x86_64", "manylinux_2_34_x86_64"]  # fmt: skip
NEEDS = "needs.txt"
REQUIRED = "transformers"  # without it nothing runs


def normalise(name: str) -> str:
    """PEP 503 name: lowercase, runs of ``-_.`` as one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name_version(path: Path) -> tuple[str, Version]:
    """Distribution name (normalised) and version from a wheel's file name."""
    name, version = path.name.split("-")[:2]
    return normalise(name), Version(version)


def lit_smd_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[Requirement]:
    """The ``[project] dependencies`` of lit_smd."""
    return [Requirement(line) for line in tomllib.loads(pyproject.read_text())["project"]["dependencies"]]


def wheel_requirements(path: Path, extras: set[str]) -> list[Requirement]:
    """A wheel's ``Requires-Dist`` that apply on the GPU machine with ``extras`` requested."""
    with zipfile.ZipFile(path) as wheel:
        meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        lines = wheel.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        marker: Marker | None = req.marker
        if marker is None or any(marker.evaluate({**TARGET, "extra": extra}) for extra in extras | {""}):
            out.append(req)
    return out


def _pip_download(spec: str, dest: Path) -> None:
    platforms = [f"--platform={p}" for p in PLATFORMS]
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
               "3.12", "--implementation", "cp", *platforms, "-d", str(dest), spec]  # fmt: skip
    subprocess.run(command, check=True)


def _tested_version(name: str, spec: SpecifierSet) -> str | None:
    """The version installed in the running environment, if it satisfies ``spec``."""
    try:
        version = metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
    return version if spec.contains(version, prereleases=True) else None


def download(dest: Path, insure_mib: float) -> dict[str, tuple[str, str]]:
    """Download the closure of lit_smd's requirements the image lacks into ``dest``.

    Returns:
        ``{name: (specifier, required by)}`` of the carried wheels (also written to ``dest / NEEDS``).
    """
    dest.mkdir(parents=True, exist_ok=True)
    specs: dict[str, SpecifierSet] = {}
    parents: dict[str, set[str]] = {}
    carried: dict[str, Path] = {}
    queue = [(req, "lit_smd") for req in lit_smd_requirements()]
    while queue:
        req, parent = queue.pop(0)
        name = normalise(req.name)
        if name in SKIP:
            continue
        spec = specs[name] = specs.get(name, SpecifierSet()) & req.specifier
        parents.setdefault(name, set()).add(parent)
        if name in IMAGE and name not in carried:
            known = IMAGE[name]
            if known is not None and spec.contains(known, prereleases=True):
                continue  # the image's version serves
        if name in carried and spec.contains(wheel_name_version(carried[name])[1], prereleases=True):
            continue
        if name in carried:
            carried.pop(name).unlink()
        pinned = _tested_version(name, spec)
        try:
            _pip_download(f"{name}=={pinned}" if pinned else f"{name}{spec}", dest)
        except subprocess.CalledProcessError:
            if pinned is None:
                raise
            _pip_download(f"{name}{spec}", dest)  # the tested version has no wheel for the machine
        found = sorted((p for p in dest.glob("*.whl") if wheel_name_version(p)[0] == name),
                       key=lambda p: wheel_name_version(p)[1])  # fmt: skip
        path = next(p for p in reversed(found) if spec.contains(wheel_name_version(p)[1], prereleases=True))
        for other in found:  # one version of each: two stop the whole install
            if other != path:
                other.unlink()
        if name in IMAGE and IMAGE[name] is None and path.stat().st_size > insure_mib * 2**20:
            path.unlink()  # the image has it, version unknown, and the wheel is large: trust the image
            continue
        carried[name] = path
        queue += [(sub, name) for sub in wheel_requirements(path, set(req.extras))]
    needs = {name: (str(specs[name]), ",".join(sorted(parents[name]))) for name in sorted(carried)}
    (dest / NEEDS).write_text("".join(f"{n}\t{s}\t{p}\n" for n, (s, p) in needs.items()))
    return needs


def _installed(name: str, site: Path | None = None) -> str | None:
    """Version of distribution ``name`` visible with ``site`` first on the path (None: not installed)."""
    paths = ([str(site)] if site is not None else []) + sys.path
    for dist in metadata.distributions(path=paths):
        if normalise(dist.metadata["Name"]) == name:
            return dist.version
    return None


def plan_install(wheels: Path, installed: dict[str, str | None]) -> list[tuple[Path, str, str | None, bool]]:
    """Which carried wheels to install: ``(wheel, specifier, installed version, install?)`` per wheel.

    A wheel is installed when its distribution is missing or the installed version misses its specifier.
    """
    needs = {}
    if (wheels / NEEDS).is_file():
        for line in (wheels / NEEDS).read_text().splitlines():
            name, spec, _ = line.split("\t")
            needs[name] = spec
    plan = []
    for path in sorted(wheels.glob("*.whl")):
        name, _ = wheel_name_version(path)
        spec, have = needs.get(name, ""), installed.get(name)
        plan.append((path, spec, have, have is None or not SpecifierSet(spec).contains(have, prereleases=True)))
    return plan


def install(wheels: Path, target: Path) -> int:
    """Install what the machine lacks into ``target``; report lit_smd's unmet requirements. Returns the exit code."""
    names = {wheel_name_version(p)[0] for p in wheels.glob("*.whl")}
    plan = plan_install(wheels, {name: _installed(name) for name in names})
    chosen = [str(path) for path, *_, go in plan if go]
    for path, spec, have, go in plan:
        print(f"  {'install' if go else 'keep   '} {path.name:60s} needs {spec or '(any)':22s} machine has {have}")
    if chosen:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(target), *chosen], check=True)  # fmt: skip
    unmet = []
    for req in lit_smd_requirements():
        name = normalise(req.name)
        have = _installed(name, target)
        if have is None or not req.specifier.contains(have, prereleases=True):
            unmet.append(name)
            why = SKIP.get(name, "not carried")
            print(f"  UNMET {req} (machine: {have}; {why})")
    print(f"installed {len(chosen)} of {len(plan)} carried wheels into {target}; lit_smd requirements unmet: "
          f"{', '.join(unmet) or 'none'}")  # fmt: skip
    return 1 if REQUIRED in unmet else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    down = sub.add_parser("download", help="here: fetch the wheels into --dest")
    down.add_argument("--dest", type=Path, default=ROOT / ".whl")
    down.add_argument("--insure-mib", type=float, default=2.0,
                      help="carry a wheel the image holds in an unlisted version when it is at most this large")
    inst = sub.add_parser("install", help="there: install the carried wheels the machine lacks into --target")
    inst.add_argument("--wheels", type=Path, default=ROOT / ".whl")
    inst.add_argument("--target", type=Path, default=Path("/tmp/site"))
    args = parser.parse_args(argv)
    if args.command == "install":
        return install(args.wheels, args.target)
    needs = download(args.dest, args.insure_mib)
    total = sum(p.stat().st_size for p in args.dest.glob("*.whl"))
    for name, (spec, parents) in needs.items():
        print(f"  {name:28s} {spec:28s} for {parents}")
    print(f"{len(needs)} wheels, {total / 2**20:.1f} MiB in {args.dest} (the device tool carries 64 MiB in all, "
          f"working tree included); not carried: {', '.join(f'{k} ({v})' for k, v in SKIP.items())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
