"""pyverbs, imported lazily, and the boundary where its errors become the project's.

Nothing here runs at import time: the first :func:`load_pyverbs` imports pyverbs, from this
environment or else from Debian's ``python3-pyverbs``, and remembers the result. A missing or
unusable pyverbs, or a machine without an RDMA device, is a
:class:`~rings.errors.TransportUnavailable` whose message names the tcp alternative.
Whatever pyverbs raises later is translated by :func:`translated` into a
:class:`~rings.errors.VerbsError` saying what failed.

The other modules of :mod:`rings.rdma` call ``_pyverbs.load_pyverbs()`` through this module,
so that tests can substitute a fake pyverbs with one ``monkeypatch.setattr``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rings.errors import DiffringError, TransportUnavailable, VerbsError

log = logging.getLogger("diffring.rings.rdma")

TCP_HINT = (
    "set disagg_config.ring_transport to 'tcp' (or 'auto', which picks tcp where there is "
    "no RDMA device)"
)

# Where Debian/Ubuntu's python3-pyverbs lives. Only the ``pyverbs`` package is imported from
# there (by file location): putting the whole folder on sys.path would shadow this
# environment's own packages with the system's.
DEBIAN_PYVERBS_PARENTS: tuple[str, ...] = ("/usr/lib/python3/dist-packages",)
_PYVERBS_MODULES = ("device", "pd", "cq", "qp", "mr", "wr", "addr", "enums", "pyverbs_error")


@dataclass(frozen=True)
class Pyverbs:
    """The pyverbs modules this transport uses (tests substitute a fake)."""

    device: Any
    pd: Any
    cq: Any
    qp: Any
    mr: Any
    wr: Any
    addr: Any
    enums: Any
    origin: str


_PV: Pyverbs | None = None
_PV_LOCK = threading.Lock()


def _pyverbs_modules(origin: str) -> Pyverbs:
    m = {name: importlib.import_module(f"pyverbs.{name}") for name in _PYVERBS_MODULES}
    return Pyverbs(
        m["device"], m["pd"], m["cq"], m["qp"], m["mr"], m["wr"], m["addr"], m["enums"], origin
    )


def _forget_pyverbs() -> None:
    for name in [n for n in sys.modules if n == "pyverbs" or n.startswith("pyverbs.")]:
        del sys.modules[name]


def _import_pyverbs() -> Pyverbs:
    reasons: list[str] = []
    try:
        return _pyverbs_modules("sys.path")
    except Exception as exc:  # ImportError, or a pyverbs built for another libibverbs
        reasons.append(f"import pyverbs: {exc}")
    for parent in DEBIAN_PYVERBS_PARENTS:
        pkg = Path(parent) / "pyverbs"
        init = pkg / "__init__.py"
        if not init.is_file():
            reasons.append(f"{pkg}: not installed")
            continue
        spec = importlib.util.spec_from_file_location(
            "pyverbs", init, submodule_search_locations=[str(pkg)]
        )
        if spec is None or spec.loader is None:
            continue
        saved = {n: m for n, m in sys.modules.items() if n == "pyverbs" or n.startswith("pyverbs.")}
        _forget_pyverbs()
        module = importlib.util.module_from_spec(spec)
        sys.modules["pyverbs"] = module
        try:
            spec.loader.exec_module(module)
            return _pyverbs_modules(str(pkg))
        except Exception as exc:  # e.g. built for another Python version
            _forget_pyverbs()
            sys.modules.update(saved)
            reasons.append(f"{pkg}: {exc}")
    raise TransportUnavailable(
        "the rdma ring transport needs pyverbs, which cannot be imported here ("
        + "; ".join(reasons)
        + "); install rdma-core's Python bindings for this Python (Debian/Ubuntu: apt-get "
        "install python3-pyverbs) or " + TCP_HINT
    )


def load_pyverbs() -> Pyverbs:
    """pyverbs (imported once); raises TransportUnavailable saying why it cannot be used."""
    global _PV
    with _PV_LOCK:
        if _PV is None:
            _PV = _import_pyverbs()
        return _PV


def device_names(pv: Pyverbs) -> list[str]:
    """Names of this machine's RDMA devices; TransportUnavailable when there are none."""
    try:
        devices = pv.device.get_device_list()
    except Exception as exc:  # PyverbsRDMAError "Failed to get devices list": no device/driver
        raise TransportUnavailable(
            f"no RDMA device on this machine (pyverbs: {exc}); {TCP_HINT}"
        ) from exc
    names = [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices]
    if not names:
        raise TransportUnavailable(f"no RDMA device on this machine; {TCP_HINT}")
    return names


def rdma_available() -> bool:
    """True when pyverbs imports and lists at least one RDMA device. Never raises."""
    try:
        return bool(device_names(load_pyverbs()))
    except Exception:
        return False


@contextlib.contextmanager
def translated(what: str, error: type[VerbsError] = VerbsError) -> Iterator[None]:
    """Turn anything pyverbs raises inside the block into ``error`` saying what failed."""
    try:
        yield
    except DiffringError:
        raise
    except Exception as exc:  # PyverbsError and friends, or TypeError/OverflowError on values
        hint = ""
        text = str(exc)
        if "Cannot allocate memory" in text or "Errno: 12" in text:
            hint = " (is the locked-memory limit, ulimit -l, too low?)"
        raise error(f"rdma: {what} failed: {text or type(exc).__name__}{hint}") from exc


def close_quietly(obj: Any) -> None:
    """Close a pyverbs object (None is skipped); a failure is logged, never raised."""
    if obj is not None:
        try:
            obj.close()
        except Exception:  # closing on an error path: report, do not mask the cause
            log.warning("rdma: closing %s failed", type(obj).__name__, exc_info=True)
