"""Command-line plumbing: commands declared once, parsed fast, helped richly.

Commands are plain functions whose parameters default to `Option(...)` / `Argument(...)` (the
same arguments as typer's; types bool, int, float, str, Path, and Optional / List of them). Running a command parses argv with argparse (a few milliseconds)
and reports a usage error as one line; only `--help` (or no arguments) builds a typer app from
the same declarations, so typer, pydantic and rich are imported only to print help. Typer alone
costs about 0.25 s per process, more than parsing a 700-line model file.

A parameter whose default is `Declared(provider)` stands for options declared elsewhere (apply's
per-case options, by the cases): `params()` lists the provider's in its place, and the command
takes them as keyword arguments. The provider gets the command line being parsed (None for
--help), so it can declare only what that command line needs (apply: the options of the case
`--case` names); a command line it fails on is parsed again with every declaration (provider(None)),
so an option only some other declaration knows reaches the command, which refuses it in its own
words.

A plain command line (known options spelled out, values that do not start with "-", the
positionals a command takes) is read without argparse, which costs more than the rest of the
command line handling (its import, gettext's locale lookup when a parser is made, an action
per option): `_plain_parse` gives argparse's result or None, and argparse parses everything
else, so every error is still argparse's. tests/test_cli_conventions.py holds the two to the
same answers on generated command lines.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from msrewrite.records import record

# The arguments of the command being run (set by cli.main): a refusal repeats them in the command
# line that edits.
COMMAND_LINE: list[str] = []

if TYPE_CHECKING:
    import argparse

COMMANDS: dict[str, Callable[..., int]] = {}


class UsageError(Exception):
    """Bad command line: printed as one `msrewrite: error: ...` line, exit 2."""


@record(frozen=True)
class Param:
    """One option or argument of a command, declared as typer's Option / Argument would be."""

    default: Any
    decls: tuple[str, ...]  # option names ("--case", "-i"); empty for an argument
    help: str
    argument: bool = False
    # declared elsewhere: the (name, type, Param) triples this placeholder stands for, in its place
    expand: Callable[[list[str] | None], list[tuple[str, Any, Param]]] | None = None

    @property
    def required(self) -> bool:
        return self.default is ...


def Option(default: Any, *decls: str, help: str = "") -> Any:  # noqa: N802 - typer's spelling
    return Param(default, decls, help)


def Argument(default: Any, help: str = "") -> Any:  # noqa: N802
    return Param(default, (), help, argument=True)


def Declared(provider: Callable[[list[str] | None], list[tuple[str, Any, Param]]]) -> Any:  # noqa: N802
    """Options declared elsewhere (apply's per-case options, by the cases), listed in this
    parameter's place; the command takes them as keyword arguments (**kwargs). provider(argv):
    those the command line argv needs; provider(None): every one (help)."""
    return Param(None, (), "", expand=provider)


def command(func: Callable[..., int]) -> Callable[..., int]:
    """Register `func` as the command of its name (underscores become dashes)."""
    COMMANDS[func.__name__.replace("_", "-")] = func
    return func


def params(func: Callable[..., int], argv: list[str] | None = None) -> list[tuple[str, Any, Param]]:
    """(name, type, declaration) of each parameter, types resolved from the annotations; a
    Declared parameter's for the command line argv (every one when None)."""
    hints = typing.get_type_hints(func)
    defaults = func.__defaults__ or ()
    names = func.__code__.co_varnames[: func.__code__.co_argcount]
    found: list[tuple[str, Any, Param]] = []
    for name, spec in zip(names[len(names) - len(defaults) :], defaults, strict=True):
        found += spec.expand(argv) if spec.expand is not None else [(name, hints[name], spec)]
    return found


def _unwrap(kind: Any) -> tuple[Any, bool]:
    """(element type, is a list) of Optional[X] / X | None / List[X] / Optional[List[X]] / list[X] | None."""
    many = False
    while typing.get_origin(kind) in (typing.Union, types.UnionType, list):
        if typing.get_origin(kind) is list:
            many = True
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    return kind, many


class _BadValue(ValueError):
    """A value refused before its command sees it; the text is argparse's message."""


def _nonempty(element: type) -> Callable[[str], Any]:
    """The converter of a str or Path value given on the command line: an empty one is refused.
    An option's default is what leaving the option out means; `--flag ""` (or `-o ""`, which
    Path would read as ".") is a value that went missing in a script, never a request for it.
    A path with a trailing slash names a folder: Path() drops the slash, so `m.py/` would
    silently read the file m.py, where the shell and open() say "Not a directory"."""

    def convert(value: str) -> Any:
        if value == "":
            raise _BadValue("an empty value (leave the option out for its default)")
        if element is Path and value.endswith("/"):
            import os

            if os.path.lexists(value.rstrip("/") or "/") and not os.path.isdir(value):
                raise _BadValue(f"{value}: not a directory (a trailing slash names a folder)")
        return element(value)

    return convert


def _converter(element: type) -> Callable[[str], Any] | None:
    """argparse's `type` for an option or argument of `element`."""
    if element in (int, float):
        return element
    return _nonempty(element)


class _Default:
    """A string default handed to argparse unconverted: argparse runs a string default through
    the option's type, and an empty default ("" for --flag) is no value the user gave."""

    def __init__(self, value: str) -> None:
        self.value = value


def _parser_class() -> type:
    import argparse

    global _PARSER
    if _PARSER is None:

        class _Parser(argparse.ArgumentParser):
            def _get_formatter(self) -> argparse.HelpFormatter:
                # argparse makes a formatter per add_argument; a fixed width spares it a shutil import and a
                # terminal-size query each time (help itself is typer's, and usage errors are one line)
                return argparse.HelpFormatter(prog=self.prog, width=80)  # the formatter_class, never changed

            def error(self, message: str) -> typing.NoReturn:
                raise UsageError(f"{self.prog.split()[-1]}: {message} (see `{self.prog} --help`)")

            def parse_intermixed_args(self, *args: Any, **kwargs: Any) -> argparse.Namespace:  # type: ignore[override]  # argparse's overloads, passed through
                namespace = super().parse_intermixed_args(*args, **kwargs)
                for dest, value in vars(namespace).items():
                    if isinstance(value, _Default):
                        setattr(namespace, dest, value.value)
                return namespace

            def _get_value(self, action: argparse.Action, arg_string: str) -> Any:
                try:
                    return super()._get_value(action, arg_string)
                except argparse.ArgumentError as exc:
                    if isinstance(exc.__context__, _BadValue):  # argparse's words would be "invalid convert value"
                        raise argparse.ArgumentError(action, str(exc.__context__)) from None
                    raise

        _PARSER = _Parser
    return _PARSER


_PARSER: type | None = None


def parser_for(name: str, func: Callable[..., int], argv: list[str] | None = None) -> argparse.ArgumentParser:
    import argparse

    # a usage line of our own: parse_intermixed_args would otherwise format argparse's (every
    # option, through textwrap and a few regexes) for error messages that _Parser.error never shows
    parser = _parser_class()(
        prog=f"msrewrite {name}", usage=f"msrewrite {name} [OPTIONS]", add_help=False, allow_abbrev=False
    )
    for pname, kind, spec in params(func, argv):
        element, many = _unwrap(kind)
        if element not in (bool, int, float, str, Path):  # our bug: a new option of a type not parsed here
            raise TypeError(f"msrewrite {name} {pname}: options are bool, int, float, str or Path, not {kind}")
        convert = _converter(element)
        if spec.argument:
            parser.add_argument(
                pname,
                metavar=pname.upper(),
                type=convert,
                nargs="*" if many else None,
                default=[] if many else argparse.SUPPRESS,
            )
        elif element is bool and any("/" in decl for decl in spec.decls):  # "--train/--no-train"
            on, off = next(decl for decl in spec.decls if "/" in decl).split("/")
            parser.add_argument(on, dest=pname, action="store_true", default=spec.default)
            parser.add_argument(off, dest=pname, action="store_false")
        elif element is bool:
            parser.add_argument(*spec.decls, dest=pname, action="store_true")
        elif many:
            parser.add_argument(*spec.decls, dest=pname, type=convert, action="append", default=spec.default)
        else:
            parser.add_argument(
                *spec.decls,
                dest=pname,
                type=convert,
                required=spec.required,
                default=None
                if spec.required
                else _Default(spec.default)
                if isinstance(spec.default, str)
                else spec.default,
            )
    return parser


def _plain_parse(func: Callable[..., int], argv: list[str]) -> dict[str, Any] | None:
    """What parser_for(...).parse_intermixed_args(argv) gives, for a plain command line: every
    token a positional that does not start with "-", a known option string spelled out in full
    (`--name` or `-n`, no `--name=value`, no bundled short options, no `--`), or the value of
    the option before it, which does not start with "-" either and converts to the option's type.
    None for anything else, and for anything argparse would refuse: it parses those itself."""
    specs = _plain_specs(func, argv)
    if specs is None:
        return None
    values, options, positionals = specs
    given = _plain_options(argv, options, values)
    if given is None:
        return None
    return _plain_positionals(given, positionals, values)


_PlainOptions = dict[str, tuple[str, str, Any]]  # option string -> (dest, action, type or constant)


def _plain_specs(
    func: Callable[..., int], argv: list[str]
) -> tuple[dict[str, Any], _PlainOptions, list[tuple[str, bool, Any]]] | None:
    """The defaults, options and positionals _plain_parse reads, or None when one is not plain."""
    values: dict[str, Any] = {}
    options: _PlainOptions = {}
    positionals: list[tuple[str, bool, Any]] = []  # (dest, takes several, type)
    for pname, kind, spec in params(func, argv):
        element, many = _unwrap(kind)
        if element not in (bool, int, float, str, Path):
            return None
        convert = _converter(element)
        if spec.argument:
            positionals.append((pname, many, convert))
            if many:
                values[pname] = []
        elif element is bool and any("/" in decl for decl in spec.decls):
            on, off = next(decl for decl in spec.decls if "/" in decl).split("/")
            options[on], options[off] = (pname, "const", True), (pname, "const", False)
            values[pname] = spec.default
        elif element is bool:
            options.update((decl, (pname, "const", True)) for decl in spec.decls)
            values[pname] = False
        elif spec.required or (many and spec.default is not None):
            return None
        else:
            options.update((decl, (pname, "append" if many else "store", convert)) for decl in spec.decls)
            values[pname] = spec.default  # a string default stays as it is (_Default)
    return values, options, positionals


def _plain_options(argv: list[str], options: _PlainOptions, values: dict[str, Any]) -> list[str] | None:
    """Read argv's options into `values`; the positional tokens, or None when argv is not plain."""
    given: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        if not token.startswith("-"):
            given.append(token)
            continue
        if token not in options:
            return None
        dest, action, arg = options[token]
        if action == "const":
            values[dest] = arg
            continue
        value = next(tokens, None)
        if value is None or value.startswith("-"):
            return None
        if arg is not None:
            try:
                value = arg(value)
            except Exception:
                return None
        if action == "append":
            values[dest] = [*(values[dest] or []), value]
        else:
            values[dest] = value
    return given


def _plain_positionals(
    given: list[str],
    positionals: list[tuple[str, bool, Any]],
    values: dict[str, Any],
) -> dict[str, Any] | None:
    for dest, many, convert in positionals:
        if many:
            taken, given = given, []
        elif given:
            taken, given = given[:1], given[1:]
        else:
            return None  # a missing positional: argparse's error
        try:
            converted = [convert(v) for v in taken] if convert is not None else taken
        except Exception:
            return None
        if many:
            if converted:
                values[dest] = converted
        else:
            values[dest] = converted[0]
    return None if given else values


def parse(name: str, argv: list[str]) -> dict[str, Any]:
    func = COMMANDS[name]
    plain = _plain_parse(func, argv)
    if plain is not None:
        return plain
    try:
        return vars(parser_for(name, func, argv).parse_intermixed_args(argv))
    except UsageError as exc:
        if not any(spec.expand is not None for spec in func.__defaults__ or ()):
            raise
        first = exc
    try:  # an option that only another declaration knows (another case's own): the command refuses it
        return vars(parser_for(name, func, None).parse_intermixed_args(argv))
    except UsageError:
        raise first from None


def wants_help(argv: list[str]) -> bool:
    return not argv or any(arg in ("-h", "--help") for arg in argv)


def rich_help(argv: list[str], version: str, summary: str) -> int:
    """Print typer's help for argv (the whole tool or one command); returns the exit code."""
    import inspect

    import typer

    app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, help=summary)

    @app.callback()
    def _top(show_version: bool = typer.Option(False, "--version", help="Print the version and exit.")) -> None:
        if show_version:
            typer.echo(f"msrewrite {version}")

    for name, func in COMMANDS.items():
        new_params = []
        for pname, kind, spec in params(func):
            make = typer.Argument if spec.argument else typer.Option
            default = (
                make(spec.default, help=spec.help) if spec.argument else make(spec.default, *spec.decls, help=spec.help)
            )
            new_params.append(
                inspect.Parameter(pname, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=kind)
            )

        def run(_func=func, **kwargs: Any) -> None:
            raise typer.Exit(_func(**kwargs))

        run.__signature__ = inspect.Signature(new_params)  # type: ignore[attr-defined]
        run.__doc__ = func.__doc__
        app.command(name)(run)
    try:
        app(args=argv or ["--help"], prog_name="msrewrite", standalone_mode=False)
    except Exception as exc:  # a click usage error next to --help: one line, like the fast path
        message = getattr(exc, "format_message", None)
        if message is None:
            raise
        raise UsageError(message()) from None
    return 0


def main(argv: list[str], version: str, summary: str) -> int:
    """Run the command argv names; UsageError for a bad command line."""
    if argv[:1] == ["--version"]:
        print(f"msrewrite {version}")
        return 0
    if wants_help(argv):
        return rich_help(argv, version, summary)
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        known = ", ".join(COMMANDS)
        raise UsageError(f"no such command {name!r} (commands: {known}; see `msrewrite --help`)")
    return COMMANDS[name](**parse(name, rest))
