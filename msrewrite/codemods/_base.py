"""The one adapter from a case to libcst's codemod interface."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, ClassVar

import libcst as cst
from libcst.codemod import CodemodCommand, CodemodContext, SkipFile


class CaseCodemod(CodemodCommand):
    """A case as a libcst codemod: `transform_module_impl` makes apply's edit (apply's own
    case_request, then Case.steps) and raises SkipFile when there is nothing to do."""

    CASE: ClassVar[str] = ""  # the case's name; empty: given with --case (AnyCase)
    DESCRIPTION: str = "Run a msrewrite case."

    @classmethod
    def add_args(cls, arg_parser: argparse.ArgumentParser) -> None:  # type: ignore[override]  # libcst's is a staticmethod; a classmethod is called the same way
        from msrewrite.cases import require_case
        from msrewrite.cases._base import CASE_OPTIONS, own_options

        if not cls.CASE:
            arg_parser.add_argument("--case", dest="case", required=True, help="the case to apply")
        arg_parser.add_argument("--mode", default="auto", help="auto, eager, npugraph-ex, ge-graph or cuda")
        arg_parser.add_argument("--target", default=None, help="Class.method to edit when several match")
        arg_parser.add_argument("--flag", default="", help="enable flag: env:NAME, attr:NAME, sglang:NAME ...")
        arg_parser.add_argument("--flag-default", dest="flag_default", default="on", help="on or off")
        arg_parser.add_argument("--max-tokens", dest="max_tokens", type=int, default=None)
        arg_parser.add_argument("--gate", default=None, help="capture, prefill, decode, always or tokens<=N")
        arg_parser.add_argument("--stream-tag", dest="stream_tag", default=None)
        arg_parser.add_argument("--assume-pure", dest="assume_pure", action="append", default=[])
        # the case's per-case options (for AnyCase every case's, the cases' own options too: the
        # case named refuses the others)
        for option in require_case(cls.CASE).add_args() if cls.CASE else (*CASE_OPTIONS, *own_options()):
            option.add_to(arg_parser)

    def __init__(self, context: CodemodContext, case: str = "", **options: object) -> None:
        super().__init__(context)
        self.case_name = self.CASE or case
        self.options = options

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        from msrewrite.commands.apply import ApplyArgs, case_request
        from msrewrite.errors import BadInput, NothingToDo
        from msrewrite.modes import resolve_mode

        text = tree.code
        path = Path(self.context.filename or "stdin.py")
        options: dict[str, Any] = dict(self.options)  # argparse's values, by ApplyArgs' names
        options["anchors"] = tuple(options.pop("anchor", None) or ())  # argparse's list
        options["assume_pure"] = tuple(options.get("assume_pure") or ())
        args = ApplyArgs.of(
            file=path,
            case=self.case_name,
            plan_path=None,
            candidate=None,
            in_place=False,
            output=None,
            verify=False,
            harness=None,
            **options,
        )  # the cases' own: ApplyArgs.extra
        try:
            chosen_mode, _why = resolve_mode(args.mode, text)
            case, case_options = case_request(args, chosen_mode)
            steps = case.steps(path, text, tree, case_options, args.target)
        except (NothingToDo, ValueError) as exc:
            raise SkipFile(str(exc)) from None
        except BadInput as exc:
            self.warn(str(exc))
            raise SkipFile(str(exc)) from None
        new_text = steps[-1].new
        if new_text == text:
            raise SkipFile("nothing to change")
        compile(new_text, str(path), "exec")  # as apply: an edit that does not compile is never written
        return cst.parse_module(new_text)
