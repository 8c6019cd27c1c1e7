"""The three worker roles, and which ring each pulls from and pushes to."""

from __future__ import annotations

import enum
from typing import Final


class Role(enum.StrEnum):
    """A worker's role, named by the stage of the pipeline it runs. A ``StrEnum``: its values
    are the names used on the command line (``--service``), in control messages and in
    metrics labels."""

    ENCODER = "encoder"
    TRANSFORMER = "transformer"
    DECODER = "decoder"


# Which ring each role pulls from and pushes to (None: the decoder writes a result).
ROLE_RINGS: Final[dict[Role, tuple[str, str | None]]] = {
    Role.ENCODER: ("request", "phase1"),
    Role.TRANSFORMER: ("phase1", "phase2"),
    Role.DECODER: ("phase2", None),
}
