"""The only door from a user-given value into emitted code.

Every value that the user (an option) or a plan file (possibly written on someone else's machine)
puts into the edited source passes one of these checks first, one function per kind of value:

- `identifier`: a local variable the edit names (anchors, `--start-after`, side inputs/outputs);
- `attribute`: a `self.<name>` the edit sets or reads (`--flag attr:NAME`, `--second-comm-group`):
  an identifier that does not shadow an `nn.Module` attribute or method;
- `env_name`: an environment variable (`--flag env:NAME`);
- `stream_tag`: a side stream's tag (a string literal and part of generated names);
- `qualified_name`: `Class.method` or `function` (`--target`, a plan's function);
- `case_name`, `comment_text`: words that end up in `# msrewrite(...)` comments and commit messages;
- `literal`: the one way a string becomes a Python string literal in emitted code.

Each check returns the value unchanged or raises ValueError with a one-line reason naming `what`
(the option or plan field), which the command turns into `msrewrite: error: ...`.
"""

from __future__ import annotations

import keyword
import re

# Attributes and methods of torch.nn.Module (torch 2.13, plus `npu`, which torch_npu patches in),
# without importing torch: setting `self.forward = True` or `self.training = ...` as a flag would
# break the module. tests/test_bad_input_options.py checks this list against the installed torch.
NN_MODULE_ATTRIBUTES = frozenset(
    """
T_destination _apply _backward_hooks _backward_pre_hooks _buffers _call_impl _compiled_call_impl
_forward_hooks _forward_hooks_always_called _forward_hooks_with_kwargs _forward_pre_hooks
_forward_pre_hooks_with_kwargs _get_backward_hooks _get_backward_pre_hooks _get_name
_is_full_backward_hook _load_from_state_dict _load_state_dict_post_hooks _load_state_dict_pre_hooks
_maybe_warn_non_full_backward_hook _modules _named_members _non_persistent_buffers_set _parameters
_register_load_state_dict_pre_hook _register_state_dict_hook _replicate_for_data_parallel
_save_to_state_dict _slow_forward _state_dict_hooks _state_dict_pre_hooks _version _wrapped_call_impl
add_module apply bfloat16 buffers call_super_init children compile cpu cuda double dump_patches eval
extra_repr float forward get_buffer get_extra_state get_parameter get_submodule half ipu
load_state_dict modules mtia named_buffers named_children named_modules named_parameters npu
parameters register_backward_hook register_buffer register_forward_hook register_forward_pre_hook
register_full_backward_hook register_full_backward_pre_hook register_load_state_dict_post_hook
register_load_state_dict_pre_hook register_module register_parameter register_state_dict_post_hook
register_state_dict_pre_hook requires_grad_ set_extra_state set_submodule share_memory state_dict to
to_empty train training type xpu zero_grad
""".split()
)

_ASCII_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_TAG = re.compile(r"[A-Za-z0-9_]+\Z")
_CASE_NAME = re.compile(r"[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*\Z")
MAX_NAME = 200  # longer names are a mistake or an attack, never a real variable
MAX_TEXT = 500


def shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _name(value: object, what: str, kind: str, pattern: re.Pattern = _ASCII_NAME) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} must be {kind}, got {shown(value)}")
    if not value or len(value) > MAX_NAME or not pattern.match(value):
        raise ValueError(f"{what} {shown(value)} is not a valid {kind} (ASCII letters, digits and _)")
    return value


def identifier(value: object, what: str, constants: bool = False) -> str:
    """A Python variable name (str.isidentifier, so no quote, space, newline or operator), not a
    keyword, not a dunder. `constants`: None, True and False pass too (names the analysis read
    from the source, never names the edit assigns)."""
    if not isinstance(value, str) or not value.isidentifier() or len(value) > MAX_NAME:
        raise ValueError(f"{what} {shown(value)} is not a valid identifier")
    name = value
    if constants and name in ("None", "True", "False"):
        return name
    if keyword.iskeyword(name):
        raise ValueError(f"{what} {name!r} is a Python keyword, not a valid identifier")
    if name.startswith("__") and name.endswith("__"):
        raise ValueError(f"{what} must not be a dunder name, got {name!r}")
    return name


def attribute(value: object, what: str) -> str:
    """A `self.<name>` the edit sets or reads: an identifier that no nn.Module member has."""
    name = identifier(value, what)
    if name in NN_MODULE_ATTRIBUTES:
        raise ValueError(f"{what} {name!r} would shadow nn.Module.{name}; choose another name")
    return name


def env_name(value: object, what: str) -> str:
    """An environment variable name as a shell exports it: ASCII letters, digits and `_`."""
    return _name(value, what, "environment variable name")


def stream_tag(value: object, what: str = "stream tag") -> str:
    """A side stream's tag: a string literal in the edit and part of the names made from it.
    Word characters only; digits may lead, as in torchair's own tags ("11", "22")."""
    return _name(value, what, "stream tag", _TAG)


def qualified_name(value: object, what: str) -> str:
    """`function`, `Class.method` or `Outer.Inner.method`."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be Class.method or function, got {shown(value)}")
    for part in value.split("."):  # dunder methods (`__call__`) are fine: the name is looked up, not made
        if not _ASCII_NAME.match(part) or keyword.iskeyword(part) or len(value) > MAX_NAME:
            raise ValueError(f"{what} must be Class.method or function, got {shown(value)}")
    return value


def case_name(value: object, what: str = "case") -> str:
    """A case name (`moe-shared-expert`) or a case branch name (`q_quant`)."""
    if not isinstance(value, str) or len(value) > MAX_NAME or not _CASE_NAME.match(value):
        raise ValueError(f"{what} {shown(value)} is not a valid case name (like moe-shared-expert)")
    return value


def comment_text(value: object, what: str) -> str:
    """Text that goes into a comment or a commit message: one line of printable characters."""
    if not isinstance(value, str):
        raise ValueError(f"{what} must be text, got {shown(value)}")
    if len(value) > MAX_TEXT or not value.isprintable():
        raise ValueError(f"{what} must be one line of printable text, got {shown(value)}")
    return value


def clipped(text: str, limit: int = MAX_TEXT) -> str:
    """`text` cut to `limit` characters (its end replaced by "..."), for a note comment_text takes."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def literal(value: str) -> str:
    """`value` as a Python string literal: repr, with double quotes when that needs no escapes
    (the house style of the emitted code). Never paste a string between quotes by hand."""
    text = repr(value)
    if text.startswith("'") and '"' not in value and "\\" not in text:
        text = '"' + text[1:-1] + '"'
    return text


def line_number(value: object, what: str, last: int | None = None) -> int:
    """A 1-based line number (a bool is not one), at most `last` when given."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be a line number, got {shown(value)}")
    if value < 1 or (last is not None and value > last):
        limit = f"1..{last}" if last is not None else ">= 1"
        raise ValueError(f"{what} {value} is out of range ({limit})")
    return value


def vouching(protect: str, assume_pure: tuple[str, ...], choices: tuple[str, ...]) -> None:
    """`--protect` one of `choices` (or "": the default) and each `--assume-pure` a class,
    function or attribute name (dotted)."""
    if protect not in ("", *choices):
        raise ValueError(f"--protect must be one of {', '.join(choices)}, got {protect!r}")
    bad_names = [n for n in assume_pure if not all(part.isidentifier() for part in n.split("."))]
    if bad_names:
        raise ValueError(f"--assume-pure needs a class, function or attribute name, got {bad_names[0]!r}")
