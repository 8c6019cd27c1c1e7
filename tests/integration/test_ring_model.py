"""The ring protocol's Promela model (rings/ring.pml), checked by spin, and kept honest.

The quick configurations of scripts/chaos/check_ring_model.py are searched exhaustively here
(about 20 s of CPU); ``python -m scripts.chaos.check_ring_model --long`` runs the large ones.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from rings.layout import SeatKind, SlotState
from scripts.chaos import check_ring_model as runner
from tests.support.paths import ROOT

pytestmark = pytest.mark.integration  # starts processes or servers

MODEL = ROOT / "rings" / "ring.pml"


def _defines(text: str) -> dict[str, int]:
    return {
        name: int(value)
        for name, value in re.findall(r"^#define\s+([A-Z_]+)\s+(-?\d+)\s*$", text, re.MULTILINE)
    }


def _disagreements(model: str) -> list[str]:
    """Where the model's stamp states and seat kinds differ from rings/layout.py's."""
    defines = _defines(model)
    out = [
        f"{m.name}: layout {m.value}, model {defines.get(m.name)}"
        for enum in (SlotState, SeatKind)
        for m in enum
        if defines.get(m.name) != m.value
    ]
    # No stamp state of the model's own that the code does not have.
    block = model.split("/* Stamp states", 1)[1].split("/* Seat kinds", 1)[0]
    out += [f"{n}: only in the model" for n in _defines(block).keys() - SlotState.__members__]
    return out


def test_model_states_are_the_layouts() -> None:
    assert _disagreements(MODEL.read_text()) == []


def test_a_disagreement_is_caught() -> None:
    model = MODEL.read_text()
    assert _disagreements(model.replace("#define ORPHANED 5", "#define ORPHANED 6")) == [
        "ORPHANED: layout 5, model 6"
    ]
    extra = model.replace("#define ORPHANED 5", "#define ORPHANED 5\n#define STALE 7")
    assert _disagreements(extra) == ["STALE: only in the model"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    problem = runner.tools_missing()
    if problem:
        pytest.fail(problem)
    quick = [c for c in runner.CONFIGS if not c.long]
    done = runner.check_all(quick, tmp_path_factory.mktemp("ring-model"))
    return {r.config.name: r for r in done}


@pytest.mark.parametrize("name", [c.name for c in runner.CONFIGS if not c.long])
def test_spin_checks_the_model(results: dict[str, Any], name: str) -> None:
    """Positive configurations: no error in the whole (non-trivial) state space; negative
    ones (a broken variant of the model): spin finds the error, so the check is not vacuous."""
    result = results[name]
    assert result.ok, f"{result.line()}\n{result.output[-3000:]}"
    if not result.config.expect_error:
        assert result.complete and result.states > 100_000, result.line()
