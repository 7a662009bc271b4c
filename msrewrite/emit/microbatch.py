"""Prefill micro-batching: two micro-batches through every layer, communication on its own stream.

The layer's forward is split into stages at its collectives (`dist.all_reduce`, `all_to_all`...):
compute, comm, compute, comm, compute. A generated `forward_microbatch(x_mb0, x_mb1)` runs each
stage once per micro-batch, micro-batch 1 one stage behind micro-batch 0, compute on the current
stream and every collective on one communication stream:

    main:  K0(0) K0(1) K1(0) K1(1) K2(0) K2(1)
    comm:     C1(0) C1(1) C2(0) C2(1)

so one micro-batch's dispatch or combine overlaps the other's compute. An event chain orders
each stage after the stage that produced its input, and because every collective is issued on
the same stream in the same order on every rank, collectives never run concurrently on a shared
communicator. The model's loop is forked into `forward_microbatch`, selected by the flag at the
top of `forward`; the original loop is untouched. Both streams wait for each other before the
micro-batches are concatenated.

This module only carries out a MicrobatchPlan (msrewrite/plan.py); which loop, which layer and
where its stages split is decided by the analysis (msrewrite/analyze/microbatch.py).
"""

from __future__ import annotations

from pathlib import Path

import libcst as cst

from msrewrite.analyze.definitions import kept_method
from msrewrite.analyze.defuse import is_docstring, node_facts
from msrewrite.analyze.microbatch import Stage, assigned_attributes, is_collective, layer_arguments, stale_plan
from msrewrite.analyze.positions import positions_for
from msrewrite.emit import frameworks
from msrewrite.emit.module_helpers import add_helpers
from msrewrite.emit.strategies import Emission
from msrewrite.emit.templates import code_of, flag_attribute, leading_lines, parse_block, rewritten, strip_leading
from msrewrite.errors import BadInput
from msrewrite.plan import MicrobatchPlan
from msrewrite.validate import literal


class _Suffix(cst.CSTTransformer):
    """Rename the layer's own variables for one micro-batch (x -> x_mb0)."""

    def __init__(self, names: set[str], suffix: str) -> None:
        self.names, self.suffix = names, suffix

    def leave_Name(self, _original, updated):
        return updated.with_changes(value=updated.value + self.suffix) if updated.value in self.names else updated

    def leave_Attribute(self, original, updated):
        return updated.with_changes(attr=original.attr)

    def leave_Arg(self, original, updated):
        return updated.with_changes(keyword=original.keyword)


class _Group(cst.CSTTransformer):
    """Every collective of micro-batch 1 goes to the layer's second process group."""

    def __init__(self, attr: str) -> None:
        self.attr = attr

    def leave_Call(self, original, updated):
        if not is_collective(original):
            return updated
        group = cst.Attribute(value=cst.Name("self"), attr=cst.Name(self.attr))
        args = [a for a in updated.args if not (a.keyword is not None and a.keyword.value == "group")]
        if args:
            args[-1] = args[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        equal = cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace(""))
        return updated.with_changes(args=[*args, cst.Arg(keyword=cst.Name("group"), value=group, equal=equal)])


def _microbatch_signature(params: cst.Parameters, split: tuple[str, ...], stores: set[str]) -> tuple[str, list[str]]:
    """(forward_microbatch's parameters: a pair per split parameter, the others as the layer's
    forward has them; the shared parameters the body rebinds, each micro-batch getting its own)."""
    kept = [
        code_of(p.with_changes(comma=cst.MaybeSentinel.DEFAULT)).strip()
        for p in params.params[1:]
        if p.name.value not in split
    ]
    if params.kwonly_params:
        kept.append("*")
        kept += [code_of(p.with_changes(comma=cst.MaybeSentinel.DEFAULT)).strip() for p in params.kwonly_params]
    if params.star_kwarg is not None:
        kept.append(f"**{params.star_kwarg.name.value}")
    signature = ", ".join(["self", *(f"{p}_mb{k}" for p in split for k in (0, 1)), *kept])
    rebound = [
        p.name.value
        for p in (*params.params[1:], *params.kwonly_params, *([params.star_kwarg] if params.star_kwarg else []))
        if p.name.value not in split and p.name.value in stores
    ]
    return signature, rebound


def _stage_order(count: int) -> list[tuple[int, int]]:
    """(stage, micro-batch) in issue order: micro-batch 1 one stage behind micro-batch 0."""
    order: list[tuple[int, int]] = [(0, 0)]
    for i in range(1, count):
        order += [(i, 0), (i - 1, 1)]
    order.append((count - 1, 1))
    return order


def layer_microbatch_method(
    func: cst.FunctionDef,
    api: str,
    stream_tag: str,
    stages: list[Stage],
    second_group: str | None = None,
    split: tuple[str, ...] | None = None,
) -> cst.FunctionDef:
    """`forward_microbatch(self, x_mb0, x_mb1)` for a layer whose forward is `forward(self, x)`, its
    body split into `stages` (the plan's). With `split` (the parameters each micro-batch gets its
    own half of: the hidden states first, then threaded state such as `past_residual`), each comes
    as a pair `p_mb0, p_mb1` and every other parameter as in the layer's forward, shared by both.

    With `second_group` (a process group the layer holds), micro-batch 1 communicates over that
    group on a second communication stream, so the two micro-batches' collectives may overlap."""
    split = split or (func.params.params[1].name.value,)
    body = _body(func)
    stores = {n for s in body for n in node_facts(s).stores}
    local = set(split) | stores
    signature, rebound = _microbatch_signature(func.params, split, stores)
    lines = [
        f"def forward_microbatch({signature}):",
        '    """forward for two micro-batches: collectives on the comm stream, one micro-batch behind (msrewrite)."""',
        *(f"    {name}_mb0 = {name}_mb1 = {name}" for name in rebound),
        f"    current_stream = {api}.current_stream()",
        f"    comm_stream = _ms_side_stream({literal(stream_tag)})",
        "    comm_stream.wait_stream(current_stream)",
    ]
    if second_group:
        lines += [
            f"    # micro-batch 1 communicates over self.{second_group} on its own stream",
            f"    comm_stream_mb1 = _ms_side_stream({literal(stream_tag + '_mb1')})",
            "    comm_stream_mb1.wait_stream(current_stream)",
        ]
    order = _stage_order(len(stages))
    produced_on: dict[tuple[int, int], str] = {}  # (stage, mb) -> event name recorded after it
    header = cst.parse_statement("\n".join(lines) + "\n    pass\n")
    assert isinstance(header, cst.FunctionDef) and isinstance(header.body, cst.IndentedBlock)
    body_nodes: list[cst.BaseStatement] = [*header.body.body[:-1]]
    for stage_index, mb in order:
        stage = stages[stage_index]
        suffix = f"_mb{mb}"
        renamed = [rewritten(strip_leading(s), _Suffix(local, suffix)) for s in stage.statements]
        comm = "comm_stream_mb1" if second_group and mb == 1 else "comm_stream"
        if second_group and mb == 1 and stage.comm:
            renamed = [rewritten(s, _Group(second_group)) for s in renamed]
        returned = _returned(renamed[-1]) if stage_index == len(stages) - 1 else None
        if returned is not None:
            renamed[-1] = cst.SimpleStatementLine(
                body=[cst.Assign(targets=[cst.AssignTarget(cst.Name(f"out{suffix}"))], value=returned)]
            )
        previous = produced_on.get((stage_index - 1, mb))
        event = f"stage{stage_index}{suffix}_done"
        last = stage_index == len(stages) - 1  # nothing waits for the last stage: no event
        what = "communication" if stage.comm else "compute"
        head = [f"# stage {stage_index} ({what}), micro-batch {mb}"]
        if stage.comm:
            wait = [f"{comm}.wait_event({previous})"] if previous else []
            record = [] if last else [f"    {event} = {comm}.record_event()"]
            text = head + [f"with {api}.stream({comm}):", *("    " + w for w in wait), "    __ms_stage__", *record]
        else:
            wait = [f"current_stream.wait_event({previous})"] if previous else []
            record = [] if last else [f"{event} = current_stream.record_event()"]
            text = head + [*wait, "__ms_stage__", *record]
        body_nodes += _splice_stage(parse_block(text), renamed)
        produced_on[(stage_index, mb)] = event
    streams = ["comm_stream", *(["comm_stream_mb1"] if second_group else [])]
    tail = [
        "# the streams meet before the micro-batches leave the layer",
        *(f"current_stream.wait_stream({name})" for name in streams),
        *(f"{name}.wait_stream(current_stream)" for name in streams),
        "return out_mb0, out_mb1",
    ]
    body_nodes += parse_block(tail)
    template = cst.parse_statement("\n".join(lines[:1]) + "\n    pass\n")
    assert isinstance(template, cst.FunctionDef)
    return template.with_changes(
        body=template.body.with_changes(body=body_nodes),
        leading_lines=[cst.EmptyLine(indent=False)],
    )


def _body(func: cst.FunctionDef) -> list[cst.BaseStatement]:
    """The statements of a forward the plan's checks (analyze/microbatch.py) read as a block."""
    assert isinstance(func.body, cst.IndentedBlock)
    return list(func.body.body)


def _returned(stmt: cst.BaseStatement) -> cst.BaseExpression | None:
    """The value of the layer's `return <value>` line (its last statement), None for another
    simple statement."""
    if not isinstance(stmt, cst.SimpleStatementLine):
        raise BadInput("prefill-microbatch: the layer's forward must end in a simple statement (its return)")
    first = stmt.body[0]
    if not isinstance(first, cst.Return):
        return None
    if first.value is None:
        raise BadInput("prefill-microbatch: the layer's forward returns no value")
    return first.value


def _splice_stage(block: list[cst.BaseStatement], stage: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
    class _Splice(cst.CSTTransformer):
        def leave_SimpleStatementLine(self, _original, updated):
            if code_of(strip_leading(updated)).strip() == "__ms_stage__":
                first = stage[0].with_changes(leading_lines=updated.leading_lines)  # keep the stage comment
                return cst.FlattenSentinel([first, *stage[1:]])
            return updated

    spliced = cst.IndentedBlock(body=block).visit(_Splice())
    assert isinstance(spliced, cst.IndentedBlock)
    return list(spliced.body)


# The model: fork its layer loop --------------------------------------------------------------------
def model_microbatch_method(func: cst.FunctionDef, loop, dim: int) -> cst.FunctionDef:
    """A copy of the model's forward whose layer loop runs both micro-batches."""
    h, var, attr = loop.carried, loop.var, loop.attr
    text = [
        "# msrewrite(prefill-microbatch): two micro-batches through every layer, then back together.",
        f"{h}_mb0, {h}_mb1 = {h}.chunk(2, dim={dim})",
        f"for {var} in self.{attr}:",
        f"    {h}_mb0, {h}_mb1 = {var}.forward_microbatch({h}_mb0, {h}_mb1)",
        f"{h} = torch.cat([{h}_mb0, {h}_mb1], dim={dim})",
    ]
    body = _body(func)
    replacement = parse_block(text)
    replacement[0] = replacement[0].with_changes(
        leading_lines=[*leading_lines(body[loop.index]), *leading_lines(replacement[0])]
    )
    body[loop.index : loop.index + 1] = replacement
    if body and is_docstring(body[0]):
        body = body[1:]
    doc = cst.parse_statement(f'"""{func.name.value} with its layers run as two micro-batches (msrewrite)."""\n')
    return func.with_changes(
        name=cst.Name("forward_microbatch"),
        body=func.body.with_changes(body=[doc, *body]),
        leading_lines=[cst.EmptyLine(indent=False)],
        decorators=(),
    )


def inplace_fork(loop, args, condition: str, comment: list[str], dim: int) -> list[cst.BaseStatement]:
    """The layer loop forked where it stands (inside its `with` blocks, after the statements that
    compute the hidden states): `if <switch>: <both micro-batches through every layer> else: <the
    original loop>`. Each micro-batch threads its own state; the threaded names are put back
    together after the loop, as the original leaves them."""
    h, var, attr = loop.carried, loop.var, loop.attr
    threaded = set(loop.targets)
    halves: list[str] = []
    pairs: list[str] = []
    for param, source in args.split:
        name = source if source in threaded else param
        whole = source
        if name == h:
            halves.append(f"{h}_mb0, {h}_mb1 = {h}.chunk(2, dim={dim})")
        else:
            halves.append(f"{name}_mb0, {name}_mb1 = (None, None) if {whole} is None else {whole}.chunk(2, dim={dim})")
        pairs += [f"{name}_mb0", f"{name}_mb1"]
    call = ", ".join([*pairs, *(f"{param}={source}" for param, source in args.shared)])
    if loop.tuple_target:
        run = [
            f"    {var}_out_mb0, {var}_out_mb1 = {var}.forward_microbatch({call})",
            f"    {', '.join(f'{t}_mb0' for t in loop.targets)} = {var}_out_mb0",
            f"    {', '.join(f'{t}_mb1' for t in loop.targets)} = {var}_out_mb1",
        ]
    else:
        run = [f"    {h}_mb0, {h}_mb1 = {var}.forward_microbatch({call})"]
    joined = [
        f"{t} = torch.cat([{t}_mb0, {t}_mb1], dim={dim})"
        if t == h
        else f"{t} = None if {t}_mb0 is None else torch.cat([{t}_mb0, {t}_mb1], dim={dim})"
        for t in loop.targets
    ]
    text = [
        *comment,
        f"if {condition}:",
        *("    " + line for line in halves),
        f"    for {var} in self.{attr}:",
        *("    " + line for line in run),
        *("    " + line for line in joined),
        "else:",
        "    __ms_original_loop__",
    ]
    original = loop.node.with_changes(leading_lines=())
    (parsed,) = parse_block(text)

    class _Original(cst.CSTTransformer):
        def leave_SimpleStatementLine(self, _old, updated):
            if code_of(strip_leading(updated)).strip() == "__ms_original_loop__":
                return original
            return updated

    fork = parsed.visit(_Original())
    assert isinstance(fork, cst.If)
    return [fork.with_changes(leading_lines=[*loop.node.leading_lines, *fork.leading_lines])]


def _forks_in_place(found, args, function: str) -> bool:
    """Whether the loop is forked where it stands. The loop as the first version took it (at the top
    of the forward, over a forward parameter) is forked into a copy of the forward, as its goldens
    show; any other, and one whose hidden states the forward computes, where it stands. BadInput
    when the forward already binds a name the fork would bind."""
    params = found.forward.params
    forward_params = {p.name.value for p in (*params.params, *params.kwonly_params)}
    if found.loop.simple and found.loop.carried in forward_params:
        return False
    facts = node_facts(found.forward.body)
    clash = [
        name for name in _introduced_names(found.loop, args) if name in facts.loads | facts.stores | forward_params
    ]
    if clash:
        raise BadInput(f"{function} already binds {clash[0]}, a name the micro-batch fork would bind")
    return True


def _introduced_names(loop, args) -> list[str]:
    """The names the in-place fork binds in the model's forward."""
    threaded = set(loop.targets)
    names = [f"{source if source in threaded else param}_mb{k}" for param, source in args.split for k in (0, 1)]
    if loop.tuple_target:
        names += [f"{loop.var}_out_mb0", f"{loop.var}_out_mb1"]
    return names


# The whole edit -----------------------------------------------------------------------------------
def _call_args(func: cst.FunctionDef) -> str:
    p = func.params
    parts = [q.name.value for q in p.params[1:]]
    if isinstance(p.star_arg, cst.Param):
        parts.append("*" + p.star_arg.name.value)
    parts += [f"{q.name.value}={q.name.value}" for q in p.kwonly_params]
    if p.star_kwarg is not None:
        parts.append("**" + p.star_kwarg.name.value)
    return ", ".join(parts)


def _flag_lines(plan: MicrobatchPlan, init: cst.FunctionDef, roots: set[str]):
    """(the switch expression, the `__init__` lines behind it, the Emission's extras) for the plan's
    flag, read as the other cases read it: env and sglang into self.enable_<name>; attr and
    vllm-ascend into self.<name>, an attribute the class already sets being reused."""
    flag = plan.flag
    default = "True" if flag.default else "False"
    keeps = "keeps the single-batch layer loop." if flag.default else "runs the layers as two micro-batches."
    label = f"# msrewrite({plan.case}):"
    set_already = assigned_attributes(init)  # as the engine reads it: set in __init__, where the edit reads it
    extras: dict = {"helpers": [], "from_imports": frameworks.flag_imports(flag, roots), "needs_os": False}
    if flag.kind in ("env", "sglang"):
        attr = flag_attribute(flag.name)
        if flag.kind == "env":
            read = f"_ms_env_flag({literal(flag.name)}, {default})"
            extras["helpers"].append("_ms_env_flag")
            extras["needs_os"] = True
        else:  # SGLang's own reader takes the default as the text it would find in the environment
            read = f"get_bool_env_var({literal(flag.name)}, {literal(default.lower())})"
        lines = [f"{label} {flag.name}={'0' if flag.default else '1'} {keeps}", f"self.{attr} = {read}"]
    elif flag.kind == "vllm-ascend":
        attr = flag.name
        switch = "false" if flag.default else "true"
        read = f"getattr(get_ascend_config(), {literal(flag.name)}, {default})"
        lines = [f"{label} additional_config {{{literal(flag.name)}: {switch}}} {keeps}", f"self.{attr} = {read}"]
    else:  # attr: reused when the class sets it, else read from __init__'s config, else the default
        attr = flag.name
        params = {p.name.value for p in (*init.params.params, *init.params.kwonly_params)}
        read = f"getattr(config, {literal(flag.name)}, {default})" if "config" in params else default
        where = "config" if "config" in params else "self"
        lines = [f"{label} {where}.{attr} = {'False' if flag.default else 'True'} {keeps}", f"self.{attr} = {read}"]
    if attr in set_already:
        lines = []
    return f"self.{attr}", lines, extras


def _model_init(model_cls: cst.ClassDef) -> cst.FunctionDef:
    init = kept_method(model_cls, "__init__")
    if init is None:  # the layer loop's self.<layers> is found in __init__, so there is one
        raise BadInput(f"{model_cls.name.value} has no __init__ to read the switch in")
    return init


def _checked_target(module: cst.Module, plan: MicrobatchPlan, text: str | None):
    """The plan's loop and layer in `module` (stale_plan), or BadInput: inside a fullgraph region, or
    a second group the layer never sets."""
    found = stale_plan(module, plan, text)
    for qualified in (plan.function, plan.layer):
        compiled = frameworks.fullgraph_region(module, qualified, text)
        if compiled is not None:
            raise BadInput(
                f"{qualified} runs inside a torch.compile fullgraph region ({compiled}): stream code there "
                "would be traced into the graph; vLLM keeps its own stream code inside a custom op"
            )
    if plan.second_group and plan.second_group not in assigned_attributes(found.layer_cls):
        raise BadInput(f"plan for {plan.function}: {found.layer} never sets self.{plan.second_group} (second_group)")
    return found


def _fork_condition(module, plan: MicrobatchPlan, found, args, switch: str, roots, extras) -> tuple[str, str]:
    """(the test that takes the micro-batch path, ", in <gate>" or ""): the switch, the rows of every
    value split with the batch (else the original loop runs), and the framework's phase predicate."""
    condition = f"_ms_microbatch({switch}, {found.loop.carried})"
    others = [source for _, source in args.split[1:]]
    if others:
        condition += f" and _ms_same_batch({', '.join([found.loop.carried, *others])})"
        extras["helpers"].append("_ms_same_batch")
    when = ""
    if plan.flag.gate is not None:  # prefill: the model forward's own phase predicate
        predicate, needed = frameworks.phase_predicate(
            plan.flag.gate, found.forward, roots, plan.function, module, Path(plan.file) if plan.file else None
        )
        extras["from_imports"] += [i for i in needed if i not in extras["from_imports"]]
        condition += f" and {predicate}"
        when = f", in {plan.flag.gate}"
    return condition, when


def microbatch_edit(module: cst.Module, plan: MicrobatchPlan, text: str | None = None, dim: int = 0) -> cst.Module:
    """The module with `plan` carried out: the forked micro-batch path for the model's layer loop.
    BadInput when the plan does not match the file (stale), or cannot be emitted here."""
    found = _checked_target(module, plan, text)
    positions = positions_for(module, plan.layer, found.layer_forward, text if text is not None else module.code)
    by_line = {positions[s].start.line: s for s in _body(found.layer_forward)}
    stages = [Stage(stage.comm, [by_line[st.first_line] for st in stage.statements]) for stage in plan.stages]
    api = "torch.cuda" if plan.mode == "cuda" else "torch.npu"
    args = layer_arguments(
        found.loop, found.layer_forward, found.forward, plan.function, plan.split_args, plan.shared_args
    )
    split = tuple(param for param, _ in args.split)
    layer_method = layer_microbatch_method(found.layer_forward, api, plan.stream_tag, stages, plan.second_group, split)
    in_place = _forks_in_place(found, args, plan.function)
    roots = frameworks.imported_roots(module)
    switch, init_lines, extras = _flag_lines(plan, _model_init(found.model_cls), roots)
    condition, when = _fork_condition(module, plan, found, args, switch, roots, extras)
    frameworks.check_own_bindings(module, extras["from_imports"])
    dispatch = [
        f"# msrewrite({plan.case}): two micro-batches on two streams when enabled{when} (forward_microbatch);",
        "# the loop below is the original path.",
        f"if {condition}:",
        f"    return self.forward_microbatch({_call_args(found.forward)})",
    ]
    model_method = model_microbatch_method(found.forward, found.loop, dim) if not in_place else None
    fork_comment = [
        f"# msrewrite({plan.case}): two micro-batches on two streams when enabled{when} (forward_microbatch",
        "# of each layer); the loop under `else` is the original path.",
    ]
    forked = inplace_fork(found.loop, args, condition, fork_comment, dim) if in_place else None
    loop_node = found.loop.node
    dispatch_nodes = list(cst.parse_module("pass\n" + "\n".join(dispatch) + "\n").body[1:])
    init_nodes = list(cst.parse_module("pass\n" + "\n".join(init_lines) + "\n").body[1:]) if init_lines else []
    model_name, layer_name = found.model, found.layer

    class _ForkLoop(cst.CSTTransformer):
        """The model's forward with its layer loop (the very node, wherever it stands) forked."""

        def leave_For(self, original, updated):
            return cst.FlattenSentinel(forked) if original is loop_node and forked else updated

    class _Edit(cst.CSTTransformer):
        def leave_ClassDef(self, original, updated):
            name = original.name.value
            if name not in (model_name, layer_name):
                return updated
            body: list[cst.BaseStatement] = []
            kept = {id(kept_method(original, "forward")), id(kept_method(original, "__init__"))}
            for old, stmt in zip(original.body.body, updated.body.body, strict=True):
                if id(old) not in kept:  # a def a later one replaces: dead code, left as it is
                    body.append(stmt)
                    continue
                if name == model_name and isinstance(stmt, cst.FunctionDef) and stmt.name.value == "forward" and forked:
                    body.append(old.visit(_ForkLoop()))  # the loop node is the original tree's
                    continue
                if name == model_name and isinstance(stmt, cst.FunctionDef) and stmt.name.value == "forward":
                    inner = _body(stmt)
                    at = 1 if inner and is_docstring(inner[0]) else 0
                    inner[at:at] = dispatch_nodes
                    assert model_method is not None
                    body += [stmt.with_changes(body=stmt.body.with_changes(body=inner)), model_method]
                    continue
                if name == model_name and isinstance(stmt, cst.FunctionDef) and stmt.name.value == "__init__":
                    stmt = stmt.with_changes(body=stmt.body.with_changes(body=[*stmt.body.body, *init_nodes]))
                body.append(stmt)
                if name == layer_name and isinstance(stmt, cst.FunctionDef) and stmt.name.value == "forward":
                    body.append(layer_method)
            return updated.with_changes(body=updated.body.with_changes(body=body))

    new = module.visit(_Edit())
    kind = "cuda" if plan.mode == "cuda" else "npu"
    em = Emission(
        helpers=[*extras["helpers"], f"_ms_side_stream:{kind}", f"_ms_microbatch:{kind}"],
        imports=["torch_npu"] if kind == "npu" else [],
        needs_os=extras["needs_os"],
        from_imports=extras["from_imports"],
    )
    return add_helpers(new, [em], plan.mode)
