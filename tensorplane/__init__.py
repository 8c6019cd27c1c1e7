"""The tensor plane: Mooncake engine, staging pool, tensor descriptors, checksums, and the
stage / pull / release protocol that moves one task's tensors between two stages.

- :mod:`tensorplane.transport` — ``Transport``: what the pool and the protocol need of an
  engine (the seam the unit tests cross with an in-process one).
- :mod:`tensorplane.engine` — ``MooncakeSettings``, ``TransferEngine`` (Mooncake's).
- :mod:`tensorplane.pool` — ``StagingPool`` (bounded: full is backpressure), its blocks in
  :mod:`tensorplane.blocks` (``BlockAllocator``: first-fit extents, release slots, tokens).
- :mod:`tensorplane.descriptor` — ``TensorDescriptor``, ``checksum``.
- :mod:`tensorplane.handoff` — ``stage_tensors``, ``stage_bytes``, ``pull_tensors``.
- :mod:`tensorplane.errors` — the transfer errors (under ``contracts.errors.TransferError``).

Depends on nothing of ours but :mod:`contracts`. Mooncake is imported lazily, so this
package imports on machines without it; torch is imported only when torch tensors or a GPU
pool are used (numpy arrays between host pools never need it).
"""
