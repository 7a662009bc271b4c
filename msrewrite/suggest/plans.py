"""What a suggest candidate is made of, and the command that carries it out.

The plan itself comes from the branch finder `apply` uses (msrewrite/plancheck.py): a candidate
proposes only what `apply --plan` accepts, and is named by the case whose own matcher finds the
same branch.
"""

from __future__ import annotations

from msrewrite.analyze.stmtgraph import CallSite, FunctionInfo, Statement, vouched
from msrewrite.plan import OverlapPlan
from msrewrite.records import record


@record(frozen=True)
class SideChoice:
    statements: tuple[int, ...]  # indices of whole statements that move
    hoist: tuple[int, CallSite] | None = None  # (join statement index, call lifted out of it)


def apply_command(case: str, qualname: str, file: str, rank: int) -> str:
    # what the reviewer vouched for goes with the command: without it, apply would refuse
    names, protect = vouched()
    given = "".join(
        [*(f" --assume-pure {name}" for name in names), f" --protect {protect}" if protect != "auto" else ""]
    )
    if case == "generic":
        return (
            f"msrewrite suggest --json{given} {file} > plans.json && "
            f"msrewrite apply --plan plans.json --candidate {rank} {file}"
        )
    return f"msrewrite apply --case {case} --target {qualname}{given} {file}"


def window_statements(info: FunctionInfo, plan: OverlapPlan) -> list[Statement]:
    """Main-path statements between the fork and the join: the work the side overlaps with."""
    side_lines = {s.first_line for s in plan.side if s.hoist is None}
    return [
        s for s in info.statements if plan.fork_line <= s.first_line < plan.join_line and s.first_line not in side_lines
    ]
