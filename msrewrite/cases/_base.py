"""What a case is: a base class and the kinds of case whose edits differ.

A case (one module of msrewrite.cases) says which calls are side work, how its plan is named and
synced, which per-case apply options it takes, and the examples it is tested and documented by.
Its kind (a subclass here) says how its edit is made: a seed call moved to a side stream (most
cases), several side streams one after another, phases, a copy branch, a model-level fork,
asynchronous communication, or core limits. The analysis lives in msrewrite/analyze/ and the finder
(msrewrite/cases/_finder.py); the emitter in msrewrite/emit/. This module imports neither when it
is loaded: `msrewrite cases` and the emitter's lookups of a case's words read only the case.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from msrewrite.cliargs import Option
from msrewrite.errors import BadInput, NothingToDo, Refused
from msrewrite.records import record

if TYPE_CHECKING:
    from typing import dataclass_transform  # Python 3.11+; only type checkers read it

    import libcst as cst

    from msrewrite.analyze.branch import SideBranch
    from msrewrite.cases._finder import Target
    from msrewrite.plan import FlagSpec, MicrobatchPlan, OverlapPlan


def describe_lines(branch: SideBranch) -> str:
    """'L12, L14-15; hoisted self.x(y)': where the side branch's statements are."""
    lines = ", ".join(
        f"L{f.first_line}" if f.first_line == f.last_line else f"L{f.first_line}-{f.last_line}"
        for f in branch.statements
    )
    hoisted = ", ".join(h.source for h in branch.hoists)
    main = ", ".join(h.source for h in branch.main_hoists)
    return "; ".join(
        p
        for p in (
            lines,
            f"hoisted {hoisted}" if hoisted else "",
            f"main work {main} hoisted before the join" if main else "",
        )
        if p
    )


@record(frozen=True)
class BranchSpec:
    """One side stream of a several-stream case: its side calls and its stream tag.

    Branches are carried out one after another, each on the code the previous one produced, so a
    later branch may re-enter an earlier branch's stream (same tag) after a join.
    """

    name: str
    is_seed: Callable[[str], bool]
    stream_tag: str
    what: str
    optional: bool = False  # absent in some models (int8 quantization): skipped, not an error


@record(frozen=True)
class CaseOption:
    """An apply option only some cases take: its name, the one line that refuses it elsewhere
    (`{case}` is the case's name), and its command-line parameters as cli.py declares options:
    (parameter, type, Option(...)). apply's parser (msrewrite/cliargs.py) and the libcst codemods'
    (add_to) are built from them.

    The built-in options below are fields of Options. A case module may declare an option of its
    own (Case.options): it needs `check`, the validator (msrewrite/validate.py) every value but a
    bool passes before the case sees it; the checked values land in Options.extra, keyed by
    parameter name, and `settle`, when given, turns them into the case's settings (e.g. a stream
    tag). apply parses a case's own options only for that case (`apply --case X` loads X alone);
    any other case refuses them with `refusal`."""

    name: str
    refusal: str
    cli: tuple[tuple[str, Any, Any], ...] = ()
    check: Callable[[Any, str], Any] | None = None  # a case's own option: each given value's validator
    settle: Callable[[Options], Options] | None = None  # a case's own option: Options.extra into settings

    def add_to(self, parser) -> None:
        """Add this option's parameters to an argparse parser (as CodemodCommand.add_args does)."""
        from msrewrite.cliargs import _unwrap

        for pname, kind, spec in self.cli:
            element, many = _unwrap(kind)
            if element is bool:
                parser.add_argument(*spec.decls, dest=pname, action="store_true", help=spec.help)
            elif many:
                parser.add_argument(*spec.decls, dest=pname, action="append", help=spec.help)
            else:
                parser.add_argument(*spec.decls, dest=pname, default=spec.default, help=spec.help)

    def given(self, values: dict[str, Any]) -> bool:
        """Whether the command line gave this option (a parameter away from its default)."""
        return any(
            values.get(pname, spec.default) not in (None, False, [], (), spec.default)
            for pname, _kind, spec in self.cli
        )

    def checked(self, values: dict[str, Any]) -> dict[str, Any]:
        """This option's given values, each through `check` (a one-line BadInput when one is bad).
        A value other than a bool needs a validator: without one it never reaches the case."""
        out: dict[str, Any] = {}
        for pname, _kind, spec in self.cli:
            value = values.get(pname, spec.default)
            if value in (None, False, [], (), spec.default):
                continue
            if isinstance(value, bool):
                out[pname] = value
                continue
            if self.check is None:  # the case's bug, never the user's: refuse rather than pass it on
                raise BadInput(f"internal error: {self.name} declares no validator; its value is not used")
            try:
                out[pname] = (
                    tuple(self.check(v, self.name) for v in value)
                    if isinstance(value, list)
                    else self.check(value, self.name)
                )
            except ValueError as exc:
                raise BadInput(str(exc)) from None
        return out


START_AFTER = CaseOption(
    "--start-after",
    "--start-after is for cases with one side branch; {case} runs several side streams one after another",
    (
        (
            "start_after",
            str | None,
            Option(
                None, "--start-after", help="ge-graph: start the side work only after this main-stream tensor exists."
            ),
        ),
    ),
)
ANCHOR = CaseOption(
    "--anchor",
    "--anchor is for phased cases; {case} runs its side branch in one piece",
    (
        (
            "anchor",
            list[str] | None,
            Option(
                None,
                "--anchor",
                help="Phased cases: a main-stream value after which the next side phase starts (repeat).",
            ),
        ),
    ),
)
CORES = CaseOption(
    "--cores",
    "--cores and --core-limit are for core-limit cases; {case} does not split cores",
    (
        ("core_preset", str, Option("a3", "--cores", help="Core-limit cases: device preset a2, a3 or a3-even.")),
        (
            "core_limit",
            str | None,
            Option(
                None, "--core-limit", help="Core-limit cases: SIDE_AIC/SIDE_AIV,MAIN_AIC/MAIN_AIV, e.g. 8/16,16/32."
            ),
        ),
    ),
)
SECOND_COMM_GROUP = CaseOption(
    "--second-comm-group",
    "--second-comm-group is for prefill-microbatch; {case} has no micro-batches",
    (
        (
            "second_comm_group",
            str | None,
            Option(
                None,
                "--second-comm-group",
                help="prefill-microbatch: the layer's second process group (self.NAME) for micro-batch 1.",
            ),
        ),
    ),
)
ALLOW_RNG_REORDER = CaseOption(
    "--allow-rng-reorder",
    "--allow-rng-reorder is for cases that move calls onto a side stream; {case} moves none",
    (
        (
            "allow_rng_reorder",
            bool,
            Option(
                False,
                "--allow-rng-reorder",
                help="Move side work that draws random numbers (dropout, torch.rand*) even when the main path draws too.",
            ),
        ),
    ),
)
PROTECT = CaseOption(
    "--protect",
    "--protect is for cases that move calls onto a side stream; {case} moves buffer copies, which "
    "--protect does not snapshot",
    (
        (
            "protect",
            str,
            Option(
                "",
                "--protect",
                help="auto (the default): snapshot at the fork each side input the main path may write before "
                "the join (one copy each, paid only with the flag on); clone: the same; none: refuse instead.",
            ),
        ),
    ),
)
# a general apply option (declared in cli.py), which a case that names its streams itself refuses
STREAM_TAG = CaseOption(
    "--stream-tag", "--stream-tag: {case} names each of its side streams itself (one tag per branch)"
)
# every case takes it (each analysis reads the file's summaries): never refused
ASSUME_PURE = CaseOption(
    "--assume-pure",
    "",
    (
        (
            "assume_pure",
            list[str] | None,
            Option(
                None,
                "--assume-pure",
                help="A callee msrewrite cannot see into that writes none of its arguments (repeat).",
            ),
        ),
    ),
)
# in the order apply lists them in --help
CLI_OPTIONS = (START_AFTER, ANCHOR, CORES, SECOND_COMM_GROUP, PROTECT, ASSUME_PURE, ALLOW_RNG_REORDER)


def cli_params(argv: list[str] | None = None) -> list[tuple[str, Any, Any]]:
    """apply's per-case parameters, as cli.apply lists them (cliargs.Declared): the built-in ones,
    then the own options (Case.options) of the case `--case` names in argv, which is loaded alone;
    with argv None (--help, or a command line that names an option of some other case) every
    case's own options."""
    own = own_options(_named_case(argv) if argv is not None else None)
    return [param for option in (*CLI_OPTIONS, *own) for param in option.cli]


def _named_case(argv: list[str]) -> str:
    """The case `--case NAME` / `--case=NAME` names in argv ("" for none)."""
    for k, token in enumerate(argv):
        if token == "--case" and k + 1 < len(argv):
            return argv[k + 1]
        if token.startswith("--case="):
            return token.partition("=")[2]
    return ""


def own_options(case: str | None = None) -> tuple[CaseOption, ...]:
    """The options cases declare in their own files (Case.options): the named case's (none for
    "" or an unknown name), or with None every case's, each parameter once."""
    from msrewrite.cases import all_cases, get_case

    if case is not None:
        found = get_case(case) if case else None
        return found.options if found is not None else ()
    seen: dict[str, CaseOption] = {}
    for item in all_cases():
        for option in item.options:
            seen.setdefault(option.name, option)
    return tuple(seen.values())


# in the order apply checks them (and lists them in --help)
CASE_OPTIONS = (START_AFTER, ANCHOR, CORES, SECOND_COMM_GROUP, ALLOW_RNG_REORDER, PROTECT, STREAM_TAG)


@record(frozen=True)
class Invalid:
    """A snippet the case must refuse, a substring of the reason it gives, and the options it is
    refused under besides --case and --mode."""

    source: str
    reason: str
    args: tuple[str, ...] = ()


@record
class Options:
    """The user's choices for one run of a case (mode, switch, stream tag, gates, effects options)."""

    mode: str = "eager"
    flag: FlagSpec | None = None
    stream_tag: str | None = None
    start_gates: tuple = field(default_factory=tuple)  # StartGate; tensor "" = the first side input
    phase_anchors: tuple[str, ...] = ()
    core_limits: tuple[int, int, int, int] | None = None
    # "auto" (the command line's default) and "clone": snapshot side inputs the main path may write
    # at the fork; "none", and "" (the library's default): refuse the move instead
    protect: str = ""
    assume_pure: tuple[str, ...] = ()  # callees a reviewer vouched for (class, function or attribute names)
    allow_rng_reorder: bool = False  # move side work even when the order of random draws changes
    second_group: str | None = None  # prefill-microbatch: micro-batch 1's process group (self.NAME)
    # --gate given (`always` included): no mode's default gate (cases/_finder.graph_decode_default)
    gate_asked: bool = False
    # a case's own options (Case.options), checked by their validators: parameter name -> value
    extra: dict[str, Any] = field(default_factory=dict)


@record
class EditStep:
    """One reviewable step of an edit: one patch of a series."""

    subject: str
    body: str
    old: str
    new: str
    plans: list[OverlapPlan | MicrobatchPlan]
    # what the case does to apply_plans' output for this step (phased: the flag-off path calls the
    # shared expert again); verify's schedule variants, made by apply_plans too, get it as well
    finish: Callable[[str], str] | None = None
    # what the case could not do alongside this step (a branch refused), said with the edit
    notes: tuple[str, ...] = ()


def match_target(name: str, target: str) -> bool:
    return name == target or name == f"{target}.forward" or name.endswith("." + target)


def parse_own_edit(text: str, what: str) -> cst.Module:
    """Parse code msrewrite itself produced: a failure is our bug, never the user's input."""
    import libcst as cst

    try:
        return cst.parse_module(text)
    except cst.ParserSyntaxError as exc:
        raise BadInput(
            f"internal error: {what} produced code that does not parse (line {exc.raw_line}); nothing written"
        ) from None


def plan_step(plan: OverlapPlan, old: str, new: str) -> EditStep:
    cls = plan.function.rsplit(".", 1)[0]
    phases = f" in {len(plan.phase_anchors) + 1} phases" if plan.phase_anchors else ""
    branch = f" {plan.case_branch}" if plan.case_branch else ""
    subject = f"{plan.case}: overlap {cls}{branch}{phases} on side stream {plan.stream_tag}"
    anchors = f"Phases start after: {', '.join(plan.phase_anchors)}\n" if plan.phase_anchors else ""
    body = (
        f"{plan.summary or plan.case}.\n\n"
        f"Function: {plan.function}\n"
        f"Mode: {plan.mode}\n"
        f"{anchors}"
        f"Switch: {plan.flag.describe()}; with it off the original statements run in\n"
        "their original order on the current stream.\n"
        "Generated by msrewrite apply."
    )
    return EditStep(subject=subject, body=body, old=old, new=new, plans=[plan])


def _has_function(module: cst.Module, target: str) -> bool:
    from msrewrite.analyze.outline import iter_functions

    return any(match_target(name, target) for name, _f, _c in iter_functions(module))


if not TYPE_CHECKING:

    def dataclass_transform(**_kwargs: Any) -> Callable[[type], type]:
        return lambda cls: cls


@dataclass_transform(kw_only_default=True, frozen_default=True)
class _Record:
    """A frozen, keyword-only record whose fields are the class annotations and whose defaults are
    class attributes, so a subclass changes a default by assigning it. Cases are records, not
    dataclasses: each dataclass kind would generate and compile its own 25-argument __init__ and
    __setattr__ when imported, which every `apply` pays at start-up. Compared and hashed by
    identity: a case is one object."""

    _fields: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = [name for name in cls.__dict__.get("__annotations__", {}) if not name.startswith("_")]
        cls._fields = (*cls._fields, *(name for name in own if name not in cls._fields))

    def __init__(self, **values: Any) -> None:
        cls = type(self)
        unknown = [name for name in values if name not in cls._fields]
        if unknown:
            raise TypeError(f"{cls.__name__}() got unexpected field(s): {', '.join(unknown)}")
        missing = [name for name in cls._fields if name not in values and not hasattr(cls, name)]
        if missing:
            raise TypeError(f"{cls.__name__}() missing field(s): {', '.join(missing)}")
        for name in cls._fields:  # on the instance, so a function default is not bound as a method
            object.__setattr__(self, name, values[name] if name in values else getattr(cls, name))

    def __setattr__(self, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")

    def replace(self, **changes: Any) -> Any:
        """A copy with some fields changed (dataclasses.replace for records)."""
        return type(self)(**{**{name: getattr(self, name) for name in self._fields}, **changes})


class Case(_Record):
    """What every case has: its name and words, modes, seed matcher, stream tag and flag, the
    per-case options it takes, and its declared examples. `find()` gives a module's targets,
    `plans()` the one plan to carry out, `steps()` the edit as reviewable steps.

    The base case is a seed call moved onto a side stream; the subclasses below change that."""

    name: str
    summary: str
    modes: tuple[str, ...]
    is_seed: Callable[[str], bool]  # dotted callee after "self." -> side work?
    stream_tag: str
    flag_name: str
    describe: Callable[[SideBranch], str] = lambda branch: describe_lines(branch)
    what: tuple[str, str] = ("the side branch", "the main path")  # for comments: side work, main work
    stream_source: str = "lazy"
    sync: str = "wait_stream"
    phased: bool = False  # inline and flatten the side calls first, then issue them in phases
    branches: tuple[BranchSpec, ...] = ()  # several side streams; empty: one branch from the fields above
    # "calls": side work is calls on submodules (is_seed); "copies": buffer copies (is_copy), joined
    # where the buffers are reused rather than where a value is read (analyze/effects.py)
    analysis: str = "calls"
    is_copy: Callable[[cst.Call], bool] | None = None
    is_host_buffer: Callable[[str], bool] | None = None  # copies: a buffer path (or method) that is host memory
    non_blocking: bool = False  # side copies get non_blocking=True
    core_limits: bool = False  # the branches get AI-core budgets (--cores / --core-limit)
    notes: str = ""
    order: int = 100  # where `msrewrite cases` lists it (then by name)
    # Declared examples. golden: models in examples/ whose edit in every mode is pinned in golden/;
    # mutants: the modes and examples whose golden edits are mutated (tests/test_mutants.py);
    # valid: snippets the case edits (and the edit verifies); invalid: snippets it refuses.
    golden_examples: tuple[str, ...] = ()
    mutant_modes: tuple[str, ...] = ()
    mutant_examples: tuple[str, ...] = ()
    valid: tuple[str, ...] = ()
    invalid: tuple[Invalid, ...] = ()
    # apply options declared in the case's own file (CaseOption with check, and settle or a kind
    # that reads Options.extra); every other case refuses them in their own words
    options: tuple[CaseOption, ...] = ()

    # -- options ---------------------------------------------------------------------------
    def add_args(self) -> tuple[CaseOption, ...]:
        """The per-case apply options this case takes (as libcst's CodemodCommand.add_args): its
        kind's and its own."""
        return (*self.kind_args(), *self.options)

    def kind_args(self) -> tuple[CaseOption, ...]:
        """The built-in per-case options this kind of case takes."""
        return (START_AFTER, PROTECT, ALLOW_RNG_REORDER, STREAM_TAG)

    def refusal(self, option: CaseOption) -> str:
        return option.refusal.format(case=self.name)

    def check_options(self, given: dict[CaseOption, bool]) -> None:
        """Refuse, in one line, a per-case option this case does not take (never ignore it): a
        built-in one (in CASE_OPTIONS' order) or another case's own."""
        taken = self.add_args()
        for option, present in given.items():
            if present and option not in taken:
                raise BadInput(self.refusal(option))

    def own_settings(self, options: Options, values: dict[str, Any]) -> Options:
        """Options with this case's own options' values (parsed, keyed by parameter name) checked
        into Options.extra, then settled (CaseOption.settle) into the case's settings."""
        for option in self.options:
            if option.given(values):
                options = dataclasses.replace(options, extra={**options.extra, **option.checked(values)})
                if option.settle is not None:
                    options = option.settle(options)
        return options

    def check_mode(self, mode: str) -> None:
        if mode not in self.modes:
            raise BadInput(f"case {self.name} does not support mode {mode} (supports {', '.join(self.modes)})")

    def with_defaults(self, options: Options) -> Options:
        return options

    # -- analysis and edit -----------------------------------------------------------------
    def find(
        self,
        path: Path,
        module: cst.Module,
        options: Options,
        text: str | None = None,
        branch: BranchSpec | None = None,
    ) -> list[Target]:
        """Every function with the case's (or one branch's) side work: a plan each, or why not."""
        from msrewrite.cases._finder import find_targets

        return find_targets(self, path, module, options, branch=branch, text=text)

    def plans(
        self,
        path: Path,
        module: cst.Module,
        options: Options,
        target: str | None,
        text: str | None = None,
    ) -> list[OverlapPlan]:
        """The one plan to carry out (in a list), or NothingToDo / BadInput saying why there is none."""
        self.check_mode(options.mode)
        targets = self.find(path, module, self.with_defaults(options), text)
        if target:
            chosen = [t for t in targets if match_target(t.function, target)]
            if not chosen:
                if not _has_function(module, target):
                    raise BadInput(f"--target {target}: no such function in {path}")
                raise NothingToDo(f"{target}: no {self.name} branch in this function")
            targets = chosen
        if not targets:
            raise NothingToDo(f"{path}: no {self.name} target found")
        plans = [t.plan for t in targets if t.plan is not None]
        if not plans:
            applied = [t.function for t in targets if t.applied]
            if applied:  # the others were refused before the first apply as well
                raise NothingToDo(f"{', '.join(applied)}: already applied, nothing to do")
            reasons = "; ".join(f"{t.function}: {t.reason}" for t in targets if not t.applied)
            remedies = tuple(
                (t.function, t.vouch_to_edit, t.clone_to_edit)
                for t in targets
                if not t.applied and (t.vouch_to_edit or t.clone_to_edit)
            )
            raise Refused(f"no safe {self.name} edit: {reasons}", remedies)
        if len(plans) > 1:
            names = ", ".join(p.function for p in plans)
            raise BadInput(f"ambiguous target: {len(plans)} functions match ({names}); pick one with --target")
        return plans

    def steps(
        self,
        path: Path,
        text: str,
        module: cst.Module,
        options: Options,
        target: str | None,
    ) -> list[EditStep]:
        """The edit, as reviewable steps (one patch each)."""
        from msrewrite.emit.engine import apply_plans

        plans = self.plans(path, module, options, target, text)
        return [plan_step(plans[0], text, apply_plans(module, plans, text).code)]


class SeedCase(Case):
    """The seed calls (submodule calls the matcher names) moved onto one side stream."""


class CoreLimitCase(SeedCase):
    """A seed call on a side stream, with AI cores split between the side and the main work."""

    core_limits: bool = True

    def kind_args(self) -> tuple[CaseOption, ...]:
        return (*super().kind_args(), CORES)

    def with_defaults(self, options: Options) -> Options:
        if options.core_limits is not None:
            return options
        from msrewrite import cores

        return dataclasses.replace(options, core_limits=cores.resolve("a3", None).as_tuple())


class AsyncCommCase(SeedCase):
    """Point-to-point transfers issued early and received late (isend/irecv): no side stream."""

    sync: str = "async-comm"

    def kind_args(self) -> tuple[CaseOption, ...]:
        return (START_AFTER, PROTECT, STREAM_TAG)


class PhasedCase(SeedCase):
    """The seed calls inlined and flattened (a refactor), then issued in phases between anchors."""

    phased: bool = True

    def kind_args(self) -> tuple[CaseOption, ...]:
        return (*super().kind_args(), ANCHOR)

    def steps(
        self,
        path: Path,
        text: str,
        module: cst.Module,
        options: Options,
        target: str | None,
    ) -> list[EditStep]:
        """First inline and flatten the side branch, then issue it in phases; the flag-off path
        calls as the original did (inline.restore_calls), and the phases run only while each
        inlined submodule's call would run its forward alone (plan.inline_guards)."""
        from msrewrite.analyze.seeds import find_helpers
        from msrewrite.emit.engine import apply_plans
        from msrewrite.emit.inline import (  # phased cases only
            inline_and_flatten,
            inline_blockers,
            inline_trace,
            restore_calls,
        )
        from msrewrite.emit.locate import locate

        self.check_mode(options.mode)
        whole = dataclasses.replace(options, start_gates=(), phase_anchors=(), core_limits=None)
        function = SeedCase.plans(self.replace(phased=False), path, module, whole, target, text)[0].function
        located = locate(module, function)
        # helpers that do only side work (`self._forward_shared_experts(h)`) are inlined too
        is_seed = find_helpers(module, located.cls, self.is_seed, functions=False).seed_predicate(self.is_seed)
        blockers = inline_blockers(module, located.cls, is_seed)
        if blockers:
            raise NothingToDo(
                f"no safe {self.name} edit: {function}: inlining {self.what[0]} would bypass what runs "
                f"in its call with the flag off too: {blockers[0]}; use moe-shared-expert, which keeps the call"
            )
        inlined_func = inline_and_flatten(module, located.cls, located.func, is_seed)
        trace = inline_trace(module, located.cls, located.func, is_seed)
        import libcst as cst

        inlined_text = cst.ensure_type(module.deep_replace(located.func, inlined_func), cst.Module).code
        inlined = parse_own_edit(inlined_text, f"inlining {self.what[0]} into {function}")
        plans = self.plans(path, inlined, dataclasses.replace(options, core_limits=None), function, inlined_text)
        # the side stream only while calling each inlined submodule would run its forward alone
        guards = tuple(f"{attr}:{cls}" for attr, cls in trace.modules)
        plans = [p.with_changes(inline_guards=guards) for p in plans]
        inlined_in_edit = locate(inlined, function).func

        def finish(new_text: str) -> str:
            """The flag-off path calls as the original did (inline.restore_calls)."""
            edited = parse_own_edit(new_text, f"the {self.name} edit")
            return restore_calls(edited, function, located.func, inlined_in_edit, trace).code

        steps = []
        if inlined_text != text:
            what = self.what[0]
            steps.append(
                EditStep(
                    subject=f"{self.name}: inline {what} into {function.rsplit('.', 1)[0]}",
                    body=(
                        f"Refactor: {what} is written out step by step in {function}, each nested\n"
                        "call bound to its own name, so the next patch can issue the steps in phases.\n"
                        "The steps skip the submodule's own call (a subclass's forward, a patched\n"
                        "forward, its hooks); the next patch calls it again on the flag-off path and\n"
                        "takes the inlined steps only while the call would run nothing else."
                    ),
                    old=text,
                    new=inlined_text,
                    plans=[],
                )
            )
        last = plan_step(plans[0], inlined_text, finish(apply_plans(inlined, plans, inlined_text).code))
        steps.append(dataclasses.replace(last, finish=finish))
        return steps


class BranchesCase(SeedCase):
    """Several side streams: each branch is planned on the code the previous one produced, so it
    sees (and may re-enter) the streams already added. One step, and one patch, per branch."""

    def kind_args(self) -> tuple[CaseOption, ...]:
        return (PROTECT, ALLOW_RNG_REORDER)

    def _branch_plans(
        self,
        spec: BranchSpec,
        path: Path,
        module: cst.Module,
        options: Options,
        target: str | None,
        text: str,
    ) -> tuple[list[OverlapPlan], list[Target]]:
        targets = self.find(path, module, options, text, branch=spec)
        if target:
            if not _has_function(module, target):
                raise BadInput(f"--target {target}: no such function in {path}")
            elsewhere = [t.function for t in targets if t.plan is not None and not match_target(t.function, target)]
            targets = [t for t in targets if match_target(t.function, target)]
            if not targets and elsewhere:  # said instead of "no side call found"
                from msrewrite.cases._finder import Target

                found_in = ", ".join(elsewhere)
                reason = f"its side call is in {found_in}, not beside the other branches in {target}"
                targets = [Target(target, reason=reason)]
        plans = [t.plan for t in targets if t.plan is not None]
        if len(plans) > 1:
            names = ", ".join(p.function for p in plans)
            raise BadInput(f"ambiguous target: {len(plans)} functions match ({names}); pick one with --target")
        return plans, targets

    def steps(
        self,
        path: Path,
        text: str,
        module: cst.Module,
        options: Options,
        target: str | None,
    ) -> list[EditStep]:
        from msrewrite.emit.engine import apply_plans
        from msrewrite.plan import OverlapPlan

        self.check_mode(options.mode)
        options = Options(
            mode=options.mode,
            flag=options.flag,
            protect=options.protect,
            assume_pure=options.assume_pure,
            allow_rng_reorder=options.allow_rng_reorder,
            extra=options.extra,
        )
        steps: list[EditStep] = []
        said: dict[str, list[str]] = {}  # "Function: reason" -> the branches refused for it, each said once
        refused: list[str] = []  # what each refused branch would have moved
        applied = 0
        for spec in self.branches:
            plans, targets = self._branch_plans(spec, path, module, options, target, text)
            applied += sum(t.applied for t in targets)
            if not plans:
                if not spec.optional and not any(t.applied for t in targets):
                    # each function named (twins refuse alike), each sentence once
                    for why in [f"{t.function}: {t.reason}" for t in targets] or ["no side call found"]:
                        said.setdefault(why, []).append(spec.name)
                    refused.append(spec.what)
                continue
            target = target or plans[0].function  # every later branch edits the same function
            new_text = apply_plans(module, plans, text).code
            steps.append(plan_step(plans[0], text, new_text))
            text, module = new_text, parse_own_edit(new_text, f"the {spec.name} edit")
        reasons = [f"{', '.join(dict.fromkeys(names))}: {why}" for why, names in said.items()]
        if not steps:
            if applied:
                raise NothingToDo(f"{self.name}: already applied, nothing to do")
            raise NothingToDo(f"no safe {self.name} edit: {'; '.join(reasons) or 'no target found'}")
        if reasons:  # the branches it could move are moved (each its own stream); the rest is said
            last = steps[-1]
            plan = last.plans[0]
            assert isinstance(plan, OverlapPlan)
            noted = plan.with_changes(summary=f"{plan.summary}; not moved: {', '.join(refused)}")
            step = plan_step(noted, last.old, last.new)
            body = step.body + "\n\nNot moved:\n" + "".join(f"- {reason}\n" for reason in reasons)
            notes = tuple(f"{self.name}: not moved: {reason}" for reason in reasons)
            steps[-1] = dataclasses.replace(step, body=body.rstrip("\n"), finish=last.finish, notes=notes)
        return steps


class CopyCase(Case):
    """Buffer copies (is_copy) moved onto a copy stream, joined where the buffers are reused."""

    analysis: str = "copies"
    sync: str = "events"
    non_blocking: bool = True

    def kind_args(self) -> tuple[CaseOption, ...]:
        return (START_AFTER, STREAM_TAG)


class MicrobatchCase(Case):
    """A model-level fork: the layer loop runs two micro-batches (analyze/microbatch.py)."""

    analysis: str = "microbatch"

    def kind_args(self) -> tuple[CaseOption, ...]:
        return (SECOND_COMM_GROUP, STREAM_TAG)

    def refusal(self, option: CaseOption) -> str:
        if option is PROTECT:
            return (
                "--protect is for cases that move calls onto a side stream; prefill-microbatch runs "
                "each micro-batch on its own slice, with nothing shared to snapshot"
            )
        if option is START_AFTER:
            return "--start-after is for cases with one side branch; prefill-microbatch forks the whole layer loop"
        return super().refusal(option)

    def steps(
        self,
        path: Path,
        text: str,
        module: cst.Module,
        options: Options,
        target: str | None,
    ) -> list[EditStep]:
        """The forked micro-batch path: a model-level plan (analyze/microbatch.py), carried out."""
        from msrewrite.analyze.budget import OverBudget, function_budget
        from msrewrite.analyze.microbatch import microbatch_plan
        from msrewrite.emit.engine import apply_plans
        from msrewrite.plan import FlagSpec

        self.check_mode(options.mode)
        flag = options.flag or FlagSpec(kind="env", name=self.flag_name)
        try:
            with function_budget(f"the layer loop of {path.name} and its layers"):
                plan = microbatch_plan(
                    module,
                    case=self.name,
                    path=path,
                    mode=options.mode,
                    flag=flag,
                    target=target,
                    stream_tag=options.stream_tag or self.stream_tag,
                    second_group=options.second_group,
                    assume_pure=options.assume_pure,
                    text=text,
                    split_args=tuple(options.extra.get("split_arg", ())),
                    shared_args=tuple(options.extra.get("shared_arg", ())),
                )
        except OverBudget as exc:
            raise NothingToDo(str(exc)) from None
        return [microbatch_step(plan, text, apply_plans(module, [plan], text).code)]  # emit/microbatch.py


def microbatch_step(plan: MicrobatchPlan, old: str, new: str) -> EditStep:
    model = plan.function.rsplit(".", 1)[0]
    body = (
        f"{model}.forward gets a forward_microbatch path: the batch runs as two micro-batches\n"
        "through every layer, each layer's collectives on a communication stream one\n"
        "micro-batch behind the other, ordered by events.\n\n"
        f"Mode: {plan.mode}\nSwitch: {plan.flag.describe()}; with it off the original layer loop runs.\n"
        "Generated by msrewrite apply."
    )
    return EditStep(f"{plan.case}: run {model} as two micro-batches", body, old, new, [plan])
