"""The parallel layout of a transformer group: one DiT worker spread over G devices.

A layout has three degrees whose product is the group size G (one process, one device per
rank):

* ``cfg`` (1 or 2): classifier-free guidance split over two sets of ranks, the conditional
  forward on one, the unconditional on the other, combined after every step. Exact: each
  rank runs the same batch-1 forward the single-device loop runs.
* ``ulysses``: DeepSpeed-Ulysses sequence parallelism (diffusers' context parallelism): each
  rank holds 1/U of the tokens; an all-to-all before attention gives it every token of
  1/U of the heads, so U must divide the DiT's head count.
* ``ring``: ring attention (diffusers' context parallelism): each rank holds 1/R of the
  tokens and the keys and values go round the ring; any head count, but the attention is
  merged block by block (log-sum-exp), so outputs differ from one device in the last bits.

Written ``cfg=2,ulysses=2`` (the key order does not matter; a missing degree is 1), in the
``transformer`` section of a service's file (``"parallel": "cfg=2,ulysses=2"``) and in the
benchmarks' ``--dit-parallel``. Rank r of the group is at ``(c, g, u)`` of a (cfg, ring,
ulysses) grid, row-major: ``r = (c * ring + g) * ulysses + u``; rank 0 is the group's face.
"""

from __future__ import annotations

from dataclasses import dataclass

from contracts.errors import ConfigError

__all__ = ["DEGREES", "ParallelLayout", "head_refusal"]

DEGREES = ("cfg", "ulysses", "ring")
"""The degrees of a layout, in the order :meth:`ParallelLayout.__str__` writes them."""


@dataclass(frozen=True)
class ParallelLayout:
    """How one DiT worker's forward is spread over its group's devices."""

    cfg: int = 1
    """1: both guidance branches on every rank; 2: half the ranks run each branch."""
    ulysses: int = 1
    """Ulysses sequence-parallel degree (must divide the DiT's attention heads)."""
    ring: int = 1
    """Ring-attention sequence-parallel degree."""

    def __post_init__(self) -> None:
        if self.cfg not in (1, 2):
            raise ConfigError(
                f"parallel: cfg must be 1 or 2 (the two guidance branches), got {self.cfg}"
            )
        for name in ("ulysses", "ring"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"parallel: {name} must be a whole number >= 1, got {value!r}")

    @property
    def size(self) -> int:
        """G: the processes (devices) of the group."""
        return self.cfg * self.ulysses * self.ring

    @property
    def sequence(self) -> int:
        """Ranks that share one forward's tokens (ulysses x ring)."""
        return self.ulysses * self.ring

    @classmethod
    def parse(cls, text: str | None) -> ParallelLayout:
        """``"cfg=2,ulysses=2"`` -> ParallelLayout(cfg=2, ulysses=2); None or "" -> one device."""
        degrees: dict[str, int] = {}
        for item in (text or "").split(","):
            item = item.strip()
            if not item:
                continue
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or key not in DEGREES:
                raise ConfigError(
                    f"parallel {text!r}: expected comma-separated DEGREE=N with DEGREE one of "
                    f"{', '.join(DEGREES)} (e.g. cfg=2,ulysses=2), got {item!r}"
                )
            if key in degrees:
                raise ConfigError(f"parallel {text!r}: {key} given twice")
            try:
                degrees[key] = int(value)
            except ValueError:
                raise ConfigError(f"parallel {text!r}: {key}={value!r} is not a number") from None
        return cls(**degrees)

    def __str__(self) -> str:
        parts = [f"{k}={getattr(self, k)}" for k in DEGREES if getattr(self, k) > 1]
        return ",".join(parts) or "single"

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(cfg, ring, ulysses)`` index of ``rank`` in the group's grid."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside a group of {self.size}")
        c, rest = divmod(rank, self.ring * self.ulysses)
        g, u = divmod(rest, self.ulysses)
        return c, g, u


def head_refusal(layout: ParallelLayout, heads: int, model: str) -> str | None:
    """Why ``layout`` cannot run a DiT with ``heads`` attention heads (None: it can).

    Ulysses hands each rank whole heads, so its degree must divide the head count (Wan2.1-14B
    has 40, Wan2.1-1.3B 12, Qwen-Image 24)."""
    if heads % layout.ulysses:
        fits = [u for u in range(2, heads + 1) if heads % u == 0 and u <= 8]
        return (
            f"parallel {layout}: ulysses={layout.ulysses} does not divide the {heads} attention "
            f"heads of {model}; use ulysses in {fits or [1]} (times ring and cfg for more "
            "devices)"
        )
    return None
