"""`.ci/run` runs exactly README's test command (Set-up), after README's install command."""

from __future__ import annotations

import re

from helpers import ROOT


def _commands(text: str) -> list[str]:
    """The lines of README's ```bash blocks."""
    return [line.strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S) for line in block.splitlines()]


def test_ci_runs_readme_test_command():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    readme = _commands((ROOT / "README.md").read_text())
    (test_command,) = [line for line in ci if line.startswith(".venv/bin/python -m pytest")]
    setup = readme.index(next(line for line in readme if "pip install torch==2.13.0 -e '.[test]'" in line))
    assert readme[setup + 1] == test_command, (readme[setup + 1], test_command)
    (install,) = [line for line in ci if "pip install" in line]
    assert install.replace("--quiet ", "") in readme[setup], (install, readme[setup])
