#!/usr/bin/env python3
"""Build an offline install bundle (wheels + .debs) for an air-gapped GPU node.

Entry point: ``scripts/offline/offline_bundle.sh`` (same arguments); docs/offline.md
explains the two commands. What it does:

1. Resolves the project's dependencies (pyproject ``dependencies`` plus ``--extras``, plus
   the Mooncake wheel of ``--mooncake``) for the *target* Python and platform and downloads
   them as wheels with ``pip download --no-deps``. Packages that match the skip list
   (``scripts/offline/offline_skip.txt``: what an image with a CUDA torch already has) are neither
   downloaded nor followed. The resolution is done here, one round of ``pip download`` per
   dependency level, because ``pip download`` with dependencies would fetch every skipped
   package too: a second torch and its CUDA libraries, gigabytes.
2. Slims the Mooncake wheel to its transfer engine: ``mooncake/engine.so`` and the shared
   objects it links (followed through DT_NEEDED), dropping the store, the clients and the
   benchmarks (~50 -> ~12 MB). The wheel keeps its name, version and a consistent RECORD.
3. Downloads (``apt-get download``, not installed) the Debian packages Mooncake links and
   the image may lack: libibverbs1, ibverbs-providers, librdmacm1, libnl-3-200,
   libnl-route-3-200, libnuma1, libcurl4 and libcurl4's dependencies.
4. For a *source extra* (``--extras sage2``: SageAttention2's Hopper kernel, which has no
   wheel on PyPI), downloads the pinned source archive into ``src/`` and copies its build
   script beside ``install_offline.sh``, which builds it on the node with the node's nvcc
   (``scripts/offline/build_sage2.py``). ``--source sage2=PATH`` takes a local archive or
   source tree instead of the download.
5. Writes ``requirements.txt`` (the roots; ``install_offline.sh`` installs them with
   ``--no-index``, so pip also checks that the skipped ones are present) and
   ``manifest.json``, and refuses a bundle over ``--max-mb``.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import urllib.request
import zipfile
from base64 import urlsafe_b64encode
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename

from scripts import ROOT

DEFAULT_DEBS = ("libibverbs1", "ibverbs-providers", "librdmacm1", "libnl-3-200",
                "libnl-route-3-200", "libnuma1", "libcurl4")
# Never bundled: the base system of every Debian/Ubuntu image, and the libraries that any
# image able to run CPython and pip has (Python's ssl, zlib and ctypes modules link libssl,
# zlib and libffi; apt links libzstd); libdb is only for SASL's on-disk user database.
ESSENTIAL_DEBS = {"libc6", "libgcc-s1", "debconf", "adduser", "libstdc++6", "passwd",
                  "perl-base", "dpkg", "init-system-helpers", "libselinux1", "libpcre2-8-0",
                  "libssl3", "zlib1g", "libffi8", "libzstd1", "libdb5.3",
                  "libsasl2-modules-db"}


SOURCE_EXTRAS: dict[str, dict[str, str]] = {
    "sage2": {
        "commit": "d1a57a546c3d395b1ffcbeecc66d81db76f3b4b5",
        "url": "https://github.com/thu-ml/SageAttention/archive/{commit}.tar.gz",
        "builder": "build_sage2.py",
        "replaces": "sageattention",
        "what": "SageAttention2's Hopper kernel (INT8 QK, FP8 PV), built on the node",
    },
}
"""Extras that are source archives, not wheels: the commit pinned (upstream's main after
the 2.2.0 release, with its sm90 fixes), where GitHub serves it, the script in
``scripts/offline/`` that builds it on the node, and the PyPI package it stands in for
(dropped from the roots: the PyPI 1.x ``sageattention`` of the ``sage`` extra would be
replaced by the build anyway)."""


def log(msg: str) -> None:
    print(f"[bundle] {msg}", file=sys.stderr, flush=True)


def read_skip(path: Path, extra: list[str]) -> list[str]:
    patterns = list(extra)
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            patterns.append(line)
    return [canonicalize_name(p) if "*" not in p else p.lower() for p in patterns]


def skipped(name: str, patterns: list[str]) -> bool:
    name = canonicalize_name(name)
    return any(fnmatch.fnmatch(name, p) for p in patterns)


def target_env(python: str) -> dict[str, str]:
    """Marker environment of the target interpreter (Linux x86_64, CPython)."""
    return {"python_version": python, "python_full_version": f"{python}.0",
            "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
            "platform_machine": "x86_64", "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "extra": ""}


def platform_tags(platform: str) -> list[str]:
    """manylinux_2_28_x86_64 -> itself and every older manylinux tag it implies (pip
    matches --platform exactly)."""
    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not m:
        return [platform]
    glibc, arch = int(m.group(1)), m.group(2)
    tags = [f"manylinux_2_{v}_{arch}" for v in range(glibc, 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    tags += [f"{name}_{arch}" for v, name in legacy.items() if glibc >= v]
    return tags


def wheel_requires(path: Path) -> list[Requirement]:
    with zipfile.ZipFile(path) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode("utf-8", "replace")
    return [Requirement(line.split(":", 1)[1].strip()) for line in text.splitlines()
            if line.startswith("Requires-Dist:")]


def pip_download(specs: list[str], dest: Path, python: str, platform: str) -> None:
    abi = "cp" + python.replace(".", "")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(dest), "--python-version", python,
           "--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none"]
    for tag in platform_tags(platform):
        cmd += ["--platform", tag]
    cmd += specs
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        err = "\n".join(ln for ln in proc.stderr.splitlines() if "Location 'file" not in ln)
        raise SystemExit(f"pip download failed for {specs}:\n{err[-3000:]}")


def resolve(roots: list[Requirement], skip: list[str], dest: Path, python: str,
            platform: str) -> dict[str, Path]:
    """Download the closure of ``roots`` minus the skipped names; returns name -> wheel."""
    env = target_env(python)
    wanted: dict[str, SpecifierSet] = {}
    have: dict[str, Path] = {}
    pending = list(roots)
    level = 0
    while pending:
        for req in pending:
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            name: str = canonicalize_name(req.name)
            if skipped(name, skip):
                continue
            wanted[name] = wanted.get(name, SpecifierSet()) & req.specifier
        todo = []
        for name, spec in sorted(wanted.items()):
            wheel = have.get(name)
            if wheel is not None:
                version = parse_wheel_filename(wheel.name)[1]
                if spec.contains(version, prereleases=True):
                    continue
                wheel.unlink()  # a later requirement excludes it: fetch another version
                del have[name]
            todo.append(f"{name}{spec}")
        if not todo:
            break
        level += 1
        log(f"level {level}: {', '.join(todo)}")
        before = set(dest.glob("*.whl"))
        pip_download(todo, dest, python, platform)
        pending = []
        for wheel in sorted(set(dest.glob("*.whl")) - before):
            name = canonicalize_name(parse_wheel_filename(wheel.name)[0])
            have[name] = wheel
            pending += wheel_requires(wheel)
    return have


# ------------------------------------------------------------------------- mooncake slimming
def needed_libs(path: Path) -> list[str]:
    """DT_NEEDED sonames of an ELF file (readelf from binutils)."""
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def _record_line(root: Path, path: Path) -> str:
    data = path.read_bytes()
    digest = urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path.relative_to(root).as_posix()},sha256={digest},{len(data)}"


def slim_mooncake(wheel: Path) -> dict[str, Any]:
    """Keep the transfer engine (engine.so and what it links) and the Python files."""
    if shutil.which("readelf") is None:
        log("readelf not found (binutils): Mooncake wheel left whole")
        return {"slimmed": False}
    size_before = wheel.stat().st_size
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(root)
        elves = {p for p in root.rglob("*") if p.is_file() and p.read_bytes()[:4] == b"\x7fELF"}
        by_name = {p.name: p for p in elves}
        engine = next((p for p in elves if p.name.startswith("engine") and
                       p.parent.name == "mooncake"), None)
        if engine is None:
            log("no mooncake/engine*.so in the wheel: left whole")
            return {"slimmed": False}
        keep, queue = set(), [engine]
        while queue:
            lib = queue.pop()
            if lib in keep:
                continue
            keep.add(lib)
            queue += [by_name[n] for n in needed_libs(lib) if n in by_name]
        dropped = sorted(p.relative_to(root).as_posix() for p in elves - keep)
        for p in elves - keep:
            p.unlink()
        record = next(root.glob("*.dist-info/RECORD"))
        lines = [_record_line(root, p) for p in sorted(root.rglob("*"))
                 if p.is_file() and p != record]
        lines.append(f"{record.relative_to(root).as_posix()},,")
        record.write_text("\n".join(lines) + "\n")
        tmp_wheel = wheel.with_suffix(".slim")
        with zipfile.ZipFile(tmp_wheel, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
            for p in sorted(root.rglob("*")):
                if p.is_file():
                    zf.write(p, p.relative_to(root).as_posix())
        tmp_wheel.replace(wheel)
    return {"slimmed": True, "kept": sorted(p.name for p in keep), "dropped": dropped,
            "bytes_before": size_before, "bytes_after": wheel.stat().st_size}


# ------------------------------------------------------------------------- debian packages
def deb_closure(names: list[str]) -> list[str]:
    """The packages and their recursive Depends, not following into the base system
    (Priority required / important, Essential, and what apt depends on): every Debian or
    Ubuntu image has those."""
    def depends(pkgs: list[str]) -> dict[str, list[str]]:
        out = subprocess.run(["apt-cache", "depends", "--no-recommends", "--no-suggests",
                              "--no-conflicts", "--no-breaks", "--no-replaces",
                              "--no-enhances", *pkgs], capture_output=True, text=True,
                             check=True).stdout
        deps: dict[str, list[str]] = {}
        current = ""
        for line in out.splitlines():
            if line and not line[0].isspace():
                current = line.strip()
                deps[current] = []
            elif "Depends:" in line and current:
                dep = line.split("Depends:", 1)[1].strip()
                if not dep.startswith("<"):
                    deps[current].append(dep)
        return deps

    def base_system(pkgs: list[str]) -> set[str]:
        out = subprocess.run(["apt-cache", "show", "--no-all-versions", *pkgs],
                             capture_output=True, text=True, check=True).stdout
        base, name = set(), ""
        for line in out.splitlines():
            if line.startswith("Package:"):
                name = line.split(":", 1)[1].strip()
            elif (line.startswith("Priority:") and line.split(":", 1)[1].strip()
                  in ("required", "important")) or line.strip() == "Essential: yes":
                base.add(name)
        return base

    def closure(roots: list[str], stop: set[str]) -> set[str]:
        seen = set(roots)
        frontier = list(roots)
        while frontier:
            found = {d for ds in depends(frontier).values() for d in ds} - seen
            found -= base_system(sorted(found)) if found else set()
            found -= stop
            seen |= found
            frontier = sorted(found)
        return seen

    # What apt itself runs on (its TLS stack included) is on every system that has apt.
    apt_base = closure(["apt"], ESSENTIAL_DEBS)
    return sorted(closure(names, ESSENTIAL_DEBS | apt_base) - ESSENTIAL_DEBS - apt_base)


def download_debs(names: list[str], dest: Path, arch: str) -> list[str]:
    dest.mkdir(parents=True, exist_ok=True)
    pkgs = deb_closure(names)
    cmd = ["apt-get", "download", "-q", *[f"{p}:{arch}" for p in pkgs]]
    proc = subprocess.run(cmd, cwd=dest, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"apt-get download failed:\n{proc.stderr[-2000:]}\n"
                         "(run `apt-get update` first, or pass --no-debs)")
    return pkgs


# ------------------------------------------------------------------------- source extras
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def bundle_source(name: str, out: Path, local: Path | None) -> dict[str, Any]:
    """Put source extra ``name`` into ``out/src/NAME.tar.gz`` (downloaded at its pinned
    commit, or from ``local``: an archive, or a source tree that is packed) and its build
    script beside install_offline.sh; returns its manifest entry."""
    spec = SOURCE_EXTRAS[name]
    src = out / "src"
    src.mkdir(parents=True, exist_ok=True)
    archive = src / f"{name}.tar.gz"
    if local is None:
        url = spec["url"].format(commit=spec["commit"])
        log(f"{name}: downloading {url}")
        with urllib.request.urlopen(url, timeout=120) as resp, archive.open("wb") as f:
            shutil.copyfileobj(resp, f)
        origin = url
    elif local.is_dir():
        with tarfile.open(archive, "w:gz") as tar:
            tar.add(local, arcname=name)
        origin = str(local)
    else:
        shutil.copy2(local, archive)
        origin = str(local)
    with tarfile.open(archive) as tar:
        top = {m.name.split("/", 1)[0] for m in tar.getmembers()}
    if len(top) != 1:
        raise SystemExit(f"{name} source {origin}: expected one top folder, found {sorted(top)}")
    shutil.copy2(ROOT / "scripts" / "offline" / spec["builder"], out / spec["builder"])
    return {"archive": f"src/{archive.name}", "folder": top.pop(), "commit": spec["commit"],
            "from": origin, "sha256": _sha256(archive), "builder": spec["builder"],
            "what": spec["what"]}


def split_extras(extras: list[str]) -> tuple[list[str], list[str]]:
    """(pyproject extras, source extras) of ``--extras``."""
    return ([e for e in extras if e not in SOURCE_EXTRAS],
            [e for e in extras if e in SOURCE_EXTRAS])


def parse_sources(items: list[str]) -> dict[str, Path]:
    """``--source NAME=PATH`` options as a dict, each name a source extra."""
    found: dict[str, Path] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or name not in SOURCE_EXTRAS:
            raise SystemExit(f"--source {item!r}: expected NAME=PATH with NAME one of "
                             f"{', '.join(SOURCE_EXTRAS)}")
        found[name] = Path(path)
    return found


# ------------------------------------------------------------------------- main
def bundle_roots(extras: list[str], mooncake: str, extra_reqs: list[str]
                 ) -> tuple[list[Requirement], list[str]]:
    """(the requirements to resolve, the source extras) of ``--extras``: the project's own,
    its pyproject extras, the Mooncake wheel of ``--mooncake`` and ``--with``. Another
    Mooncake flavour named by an extra (cpu, cuda) gives way to ``--mooncake``; the PyPI
    package a source extra stands in for is left out (PyPI's sageattention 1.x: the build
    would replace it)."""
    assert canonicalize_name(mooncake).startswith("mooncake"), "--mooncake names a Mooncake wheel"
    wheel_extras, source_extras = split_extras(extras)
    replaced = {canonicalize_name(SOURCE_EXTRAS[s]["replaces"]) for s in source_extras}
    roots = [r for r in project_roots(wheel_extras)
             if not canonicalize_name(r.name).startswith("mooncake")
             and canonicalize_name(r.name) not in replaced]
    roots += [Requirement(mooncake), *(Requirement(r) for r in extra_reqs)]
    return roots, source_extras


def project_roots(extras: list[str]) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise SystemExit(f"unknown extra {extra!r}; pyproject has {', '.join(optional)}")
        reqs += [Requirement(r) for r in optional[extra]]
    return reqs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--python", default="3.12", help="target Python, e.g. 3.12")
    ap.add_argument("--platform", default="manylinux_2_28_x86_64")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--extras", default="sage,fp8",
                    help="pyproject extras to add (comma list), and source extras "
                         f"({', '.join(SOURCE_EXTRAS)}: built on the node)")
    ap.add_argument("--source", action="append", default=[], metavar="NAME=PATH",
                    help="a source extra from a local archive or tree, not downloaded")
    ap.add_argument("--mooncake", default="mooncake-transfer-engine-cuda13",
                    help="Mooncake wheel: mooncake-transfer-engine-cuda13 (CUDA 13 torch), "
                         "mooncake-transfer-engine (CUDA 12), "
                         "mooncake-transfer-engine-non-cuda (CPU)")
    ap.add_argument("--with", dest="extra_reqs", action="append", default=[],
                    metavar="REQ", help="one more requirement to bundle (repeatable)")
    ap.add_argument("--skip-file", type=Path,
                    default=ROOT / "scripts" / "offline" / "offline_skip.txt")
    ap.add_argument("--skip", action="append", default=[], metavar="NAME")
    ap.add_argument("--no-slim", action="store_true", help="keep the whole Mooncake wheel")
    ap.add_argument("--debs", default=",".join(DEFAULT_DEBS))
    ap.add_argument("--no-debs", action="store_true")
    ap.add_argument("--deb-arch", default="amd64")
    ap.add_argument("--max-mb", type=float, default=64.0)
    args = ap.parse_args(argv)

    out: Path = args.out
    wheels = out / "wheels"
    if wheels.exists():
        shutil.rmtree(wheels)
    wheels.mkdir(parents=True)
    skip = read_skip(args.skip_file, args.skip)
    extras = [e for e in args.extras.split(",") if e]
    local_sources = parse_sources(args.source)
    roots, source_extras = bundle_roots(extras, args.mooncake, args.extra_reqs)
    have = resolve(roots, skip, wheels, args.python, args.platform)
    slim: dict[str, Any] = {}
    for name, wheel in have.items():
        if name.startswith("mooncake-transfer-engine") and not args.no_slim:
            slim = slim_mooncake(wheel)
            log(f"mooncake slimmed: {slim.get('bytes_before', 0) >> 20} -> "
                f"{slim.get('bytes_after', 0) >> 20} MiB")
    debs: list[str] = []
    if not args.no_debs:
        if (out / "debs").exists():
            shutil.rmtree(out / "debs")
        debs = download_debs(args.debs.split(","), out / "debs", args.deb_arch)
    if (out / "src").exists():
        shutil.rmtree(out / "src")
    sources = {s: bundle_source(s, out, local_sources.get(s)) for s in source_extras}
    env = target_env(args.python)
    req_lines = [str(r) for r in roots if r.marker is None or r.marker.evaluate(env)]
    (out / "requirements.txt").write_text(
        "# roots: install_offline.sh installs these with --no-index; the skipped ones must be\n"
        "# on the target already (pip checks it)\n" + "\n".join(req_lines) + "\n")
    sizes = {p.name: p.stat().st_size for p in sorted(wheels.glob("*.whl"))}
    deb_sizes = {p.name: p.stat().st_size for p in sorted((out / "debs").glob("*.deb"))}
    src_sizes = {p.name: p.stat().st_size for p in sorted((out / "src").glob("*.tar.gz"))}
    total = sum(sizes.values()) + sum(deb_sizes.values()) + sum(src_sizes.values())
    manifest = {
        "python": args.python, "platform": args.platform, "mooncake": args.mooncake,
        "extras": extras, "skip_patterns": skip, "wheels": sizes, "debs": deb_sizes,
        "deb_packages": debs, "mooncake_slim": slim, "sources": sources,
        "total_bytes": total,
        "built_with": {"python": sys.version.split()[0], "host": os.uname().release},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    shutil.copy2(ROOT / "scripts" / "offline" / "install_offline.sh", out / "install_offline.sh")
    for name, size in {**sizes, **deb_sizes, **src_sizes}.items():
        print(f"{size / 2**20:8.2f} MiB  {name}")
    print(f"{total / 2**20:8.2f} MiB  total ({len(sizes)} wheels, {len(deb_sizes)} debs, "
          f"{len(src_sizes)} sources) in {out}")
    if total > args.max_mb * 2**20:
        raise SystemExit(f"bundle is {total / 2**20:.1f} MiB, over --max-mb {args.max_mb}: "
                         "skip more (--skip NAME) or raise --max-mb")
    return 0


if __name__ == "__main__":
    sys.exit(main())
