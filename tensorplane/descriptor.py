"""Tensor descriptors (what travels in a ring slot for one staged tensor) and checksums.

Checksums: ``crc32`` (zlib, over the bytes) when the producer's pool is in host memory;
``wsum64`` (a position-weighted sum of 16-bit words computed with torch ops on the pool's
device, so no device-to-host copy) when it is in GPU memory. The descriptor names the
algorithm, so a consumer on either kind of device can verify either.

Importing this module does not import torch: a host-memory process (the synthetic pipeline's
workers, the controller's image stager) hashes plain buffers; torch is imported only to hash
a torch tensor, or to name a torch dtype (:func:`torch_dtype`).
"""

from __future__ import annotations

import math
import sys
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Final

from tensorplane.errors import DescriptorError

if TYPE_CHECKING:
    import numpy as np
    import torch

CHECKSUM_CRC32: Final = "crc32"
CHECKSUM_WSUM64: Final = "wsum64"
CHECKSUMS: Final = (CHECKSUM_CRC32, CHECKSUM_WSUM64)

TENSOR_DTYPES: Final[dict[str, int]] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}
"""The dtypes a descriptor may name (torch's names without the prefix) and their sizes."""


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a descriptor dtype name (imports torch)."""
    import torch

    dtype: torch.dtype = getattr(torch, name)
    return dtype


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype of a descriptor dtype name; bfloat16 has none (pull it as torch)."""
    import numpy as np

    if name == "bfloat16":
        raise DescriptorError("bfloat16 has no numpy dtype; pull it as a torch tensor")
    return np.dtype(name)


def dtype_name(tensor: Any) -> str | None:
    """The descriptor dtype name of a torch tensor or numpy array, None if not carried."""
    if is_torch(tensor):
        name = str(tensor.dtype).removeprefix("torch.")
    else:
        name = str(getattr(getattr(tensor, "dtype", None), "name", ""))
    return name if name in TENSOR_DTYPES else None


def is_torch(data: Any) -> bool:
    """Whether ``data`` is a torch tensor (without importing torch: if torch was never
    imported, nothing can be one)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(data, torch.Tensor)


# ------------------------------------------------------------------------------ checksums
def checksum(data: Any, algo: str) -> int:
    """Hash bytes with ``algo`` (``crc32`` or ``wsum64``); both deterministic. ``data`` is a
    1-D uint8 torch tensor (on any device) or a host buffer (memoryview, bytes, ndarray)."""
    if algo not in CHECKSUMS:
        raise DescriptorError(f"unknown checksum algorithm {algo!r}")
    if is_torch(data):
        if algo == CHECKSUM_WSUM64:
            return _wsum64(data)
        # crc32 needs host bytes; a GPU block pays a copy here (only when a CPU producer
        # feeds a GPU pool). ~3.4 GB/s on the CPU machines, and zlib releases the GIL.
        host = data.cpu() if data.device.type != "cpu" else data
        return zlib.crc32(host.numpy().data) if host.numel() else 0
    if algo == CHECKSUM_CRC32:
        return zlib.crc32(data)
    return _wsum64_host(memoryview(data).cast("B"))


_WSUM_CHUNK: Final = 1 << 24  # 16-bit words per partial sum: keeps every partial < 2**56


def _wsum64_host(data: memoryview) -> int:
    """:func:`_wsum64` over a host buffer with numpy (same definition, same value)."""
    import numpy as np

    n = len(data)
    half = n // 2
    words = np.frombuffer(data, dtype="<u2", count=half)
    a = b = 0
    for start in range(0, half, _WSUM_CHUNK):
        x = words[start : start + _WSUM_CHUNK].astype(np.int64)
        w = np.arange(start, start + x.size, dtype=np.int64) % 65521 + 1
        a += int(x.sum())
        b += int((x * w).sum())
    if n % 2:
        x_last = data[n - 1]
        a += x_last
        b += x_last * (half % 65521 + 1)
    return ((b & 0xFFFFFFFF) << 32) | (a & 0xFFFFFFFF)


def _wsum64(data: torch.Tensor) -> int:
    """Fletcher-like hash that runs where the data is (GPU): ``a = sum(x_i)``,
    ``b = sum(x_i * (i mod 65521 + 1))`` over little-endian 16-bit words, packed as
    ``(b mod 2**32) << 32 | (a mod 2**32)``. Products stay below 2**32 and each chunk's sum
    below 2**56, so int64 never overflows and the result does not depend on reduction order.
    Any single-word change alters ``a``; swapped words alter ``b``."""
    import torch

    n = data.numel()
    half = n // 2
    words = data[: 2 * half]
    if words.data_ptr() % 2:
        words = words.clone()
    words16 = words.view(torch.int16)
    a = b = 0
    for start in range(0, half, _WSUM_CHUNK):
        x = words16[start : start + _WSUM_CHUNK].to(torch.int64) & 0xFFFF
        w = torch.arange(start, start + x.numel(), dtype=torch.int64, device=x.device)
        w = w % 65521 + 1
        a += int(x.sum())
        b += int((x * w).sum())
    if n % 2:
        x_last = int(data[n - 1])
        a += x_last
        b += x_last * (half % 65521 + 1)
    return ((b & 0xFFFFFFFF) << 32) | (a & 0xFFFFFFFF)


# ----------------------------------------------------------------------------- descriptor
@dataclass(frozen=True)
class TensorDescriptor:
    """Where a staged tensor lives and how to check and release it; travels in ring slots."""

    name: str
    """Tensor name within the task (e.g. ``prompt_embeds``)."""
    segment: str
    """Producer's Mooncake session id ("host:rpcport")."""
    address: int
    """Address of the bytes in the producer's registered pool (0 for an empty tensor)."""
    nbytes: int
    """Byte count: numel x element size (bf16 stays 2 bytes)."""
    dtype: str
    """torch dtype name without the prefix: float32, bfloat16, uint8, int64, ..."""
    shape: tuple[int, ...]
    """Tensor shape; the bytes are the row-major (contiguous) layout."""
    checksum: int
    """Hash of the bytes with ``checksum_algo``."""
    release_addr: int
    """Producer's release word for this block (0: nothing to release)."""
    release_token: int
    """Generation number of this allocation; writing it into the release word frees it."""
    checksum_algo: str = CHECKSUM_CRC32
    """``crc32`` (host pool) or ``wsum64`` (GPU pool)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            want: type = tuple if f.name == "shape" else (str if f.type == "str" else int)
            if not isinstance(value, want) or isinstance(value, bool):
                raise DescriptorError(f"descriptor field {f.name} has type "
                                      f"{type(value).__name__}", tensor=str(self.name))
        if self.dtype not in TENSOR_DTYPES:
            raise DescriptorError(f"unsupported dtype {self.dtype!r}", tensor=self.name)
        if self.checksum_algo not in CHECKSUMS:
            raise DescriptorError(f"unknown checksum {self.checksum_algo!r}", tensor=self.name)
        if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in self.shape):
            raise DescriptorError(f"bad shape {self.shape!r}", tensor=self.name)
        itemsize = TENSOR_DTYPES[self.dtype]
        if self.nbytes != math.prod(self.shape) * itemsize:
            raise DescriptorError(
                f"nbytes {self.nbytes} != prod{self.shape} x {itemsize}", tensor=self.name
            )
        if min(self.address, self.release_addr, self.release_token, self.checksum) < 0:
            raise DescriptorError("negative address, token or checksum", tensor=self.name)

    def to_dict(self) -> dict[str, Any]:
        """Plain msgpack-able map (shape as a list)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["shape"] = list(self.shape)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TensorDescriptor:
        """Inverse of :meth:`to_dict`; unknown keys and missing required keys are errors."""
        if not isinstance(data, Mapping):
            raise DescriptorError(f"descriptor must be a map, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in set(data) - known)
        if unknown:
            raise DescriptorError(f"unknown descriptor key(s): {', '.join(unknown)}",
                                  tensor=str(data.get("name")))
        missing = sorted(known - set(data) - {"checksum_algo"})
        if missing:
            raise DescriptorError(f"missing descriptor key(s): {', '.join(missing)}",
                                  tensor=str(data.get("name")))
        values = dict(data)
        if not isinstance(values["shape"], list | tuple):
            raise DescriptorError("descriptor shape must be a list", tensor=str(data["name"]))
        values["shape"] = tuple(values["shape"])
        return cls(**values)
