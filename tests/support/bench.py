"""The benchmark commands the docs plan (docs/benchmarks.md) or report (BENCHMARKS.md), read
back as argument lists, so a test can check each one parses and its plan is complete."""

from __future__ import annotations

import re
import shlex

from tests.support.paths import ROOT


def planned_commands(heading: str = "## Serving under 24 GiB caps (issue 20)",
                     doc: str = "docs/benchmarks.md") -> list[list[str]]:
    """The benchmark commands of one section of ``doc`` (by default the issue-20 runs of
    docs/benchmarks.md), as argument lists. The section ends at the next heading of its
    level or above."""
    text = (ROOT / doc).read_text()
    section = text.split(heading, 1)[1]
    level = heading.split(" ", 1)[0]
    section = re.split(rf"\n#{{1,{len(level)}}} ", section, maxsplit=1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words and "=" in words[0] and not words[0].startswith("-"):
                words.pop(0)  # leading VAR=value assignments
            if words[:2] == ["python3", "-m"] and words[2].startswith("scripts.bench."):
                commands.append(words[2:])
    return commands
