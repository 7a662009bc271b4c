"""Build a runnable model and inputs from a model file: the harness `suggest` and `verify` share.

Three ways in:
- a user harness `H.py:make` returning `(module, inputs)`;
- a transformers modeling file: its config class with tiny dimensions, random weights;
- a plain nn.Module class built without arguments and fed `input_shape`.

Constructor arguments are recorded while the module is built, so `Harness.rebuild_from` can build
the same class from a rewritten copy of the file and compare the two on the same inputs.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.machinery
import importlib.util
import inspect
import itertools
import os
import pickle
import re
import select
import signal
import sys
import time
import types
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch

from msrewrite.errors import BadInput, MsrewriteError
from msrewrite.registrations import kept_registrations

TOKENS = 8  # sequence length of the example input
_unique = itertools.count()

# Tiny dimensions for transformers configs; only names the config class knows are set.
TINY_CONFIG: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "ffn_hidden_size": 128,
    "moe_intermediate_size": 32,
    "expert_ffn_hidden_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_layers": 2,  # LongcatFlash: logical layers, each with two sublayers
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "n_routed_experts": 8,
    "num_experts": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "n_shared_experts": 1,
    "num_shared_experts": 1,  # Cohere2-MoE, Ernie-4.5 and others default to none: the tiny model has one
    "shared_intermediate_size": 32,  # GraniteMoeShared: 0 (the default) builds no shared MLP
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,  # DeepseekV3: layer 0 dense, layer 1 MoE
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "zero_expert_num": 2,  # LongcatFlash identity experts
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "layer_types": ["linear_attention", "full_attention"],  # Qwen3Next: layer 1 is full attention + MoE
    "pad_token_id": 0,
}


@dataclass
class Harness:
    """A built module, its example inputs, and how it was built."""

    module: torch.nn.Module
    args: tuple
    kwargs: dict
    config: object | None
    target: str  # class name of `module`
    init_args: tuple = ()
    init_kwargs: dict = field(default_factory=dict)
    seed: int = 0
    source: str = ""  # how it was built: "harness", "transformers" or "module"
    # A user harness is run again on the other file (`rebuild_from`), so what make() does after
    # construction (binding a method, setting a switch) reaches the rebuilt module too.
    make_file: Path | None = None
    make_name: str = ""
    model_name: str = ""  # the name the harness imports the model file by ("": make() is in it)

    def run(self) -> Any:
        with torch.no_grad():
            return self.module(*clone_tree(self.args), **clone_tree(self.kwargs))

    def rebuild_from(self, other_module: types.ModuleType) -> Harness:
        """The same class from another loaded file, same constructor arguments, weights and inputs."""
        cls = getattr(other_module, self.target, None)
        if not isinstance(cls, type) or not issubclass(cls, torch.nn.Module):
            raise BadInput(f"{getattr(other_module, '__file__', other_module)} has no nn.Module class {self.target}")
        manual_seed(self.seed)
        module = self._remade(other_module, cls)
        if module is None:
            try:
                module = cls(*self.init_args, **self.init_kwargs)
            except Exception as exc:  # user code: report, do not crash
                raise BadInput(f"cannot build {self.target} from the other file: {one_line(exc)}") from None
        state = self.module.state_dict()
        result = module.load_state_dict(state, strict=False)
        missing_old = [k for k in result.missing_keys if k in state]
        if result.unexpected_keys or missing_old:
            keys = (result.unexpected_keys or missing_old)[:3]
            raise BadInput(f"weights of {self.target} do not match between the files: {', '.join(keys)}")
        module.to(next(self.module.parameters(), torch.empty(0)).dtype).eval()
        return Harness(
            module=module,
            args=clone_tree(self.args),
            kwargs=clone_tree(self.kwargs),
            config=self.config,
            target=self.target,
            init_args=self.init_args,
            init_kwargs=self.init_kwargs,
            seed=self.seed,
            source=self.source,
            make_file=self.make_file,
            make_name=self.make_name,
            model_name=self.model_name,
        )

    def _remade(self, other_module: types.ModuleType, cls: type) -> torch.nn.Module | None:
        """`cls` built by the user's make() run against `other_module`; None when the harness does
        not build it from there (a harness that imports the model some other way): the caller then
        calls the constructor with the recorded arguments, as before."""
        if self.make_file is None:
            return None
        if not self.model_name:
            make = getattr(other_module, self.make_name, None)  # make() in the model file itself
        else:
            make = self._external_make(other_module)
        if not callable(make):
            return None
        try:
            result = make()
        except Exception as exc:  # user code: report, do not crash
            raise BadInput(
                f"cannot build {self.target} from the other file: {self.make_name}() failed: {one_line(exc)}"
            ) from None
        built = result[0] if isinstance(result, tuple) and len(result) == 2 else None
        return built if isinstance(built, torch.nn.Module) and type(built) is cls else None

    def _external_make(self, other_module: types.ModuleType) -> Callable[[], Any] | None:
        """The harness file's make, loaded afresh while its model import names `other_module`."""
        assert self.make_file is not None
        name = self.model_name
        saved = sys.modules.get(name)
        sys.modules[name] = other_module
        try:
            harness_module = load_module(self.make_file, name=f"_msrewrite_harness_{next(_unique)}")
        except BadInput:
            return None
        finally:
            if saved is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = saved
        make = getattr(harness_module, self.make_name, None)
        if not callable(make):
            return None

        def run_with_model() -> Any:
            saved = sys.modules.get(name)
            sys.modules[name] = other_module
            try:
                return make()
            finally:
                if saved is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = saved

        return run_with_model


# Loading -------------------------------------------------------------------------------------
def package_of(path: Path) -> str | None:
    """Dotted package of a file, found by walking up folders that hold an `__init__.py`."""
    parts: list[str] = []
    folder = path.resolve().parent
    while (folder / "__init__.py").exists():
        parts.append(folder.name)
        folder = folder.parent
    return ".".join(reversed(parts)) or None


def _package_root(path: Path, package: str) -> Path:
    folder = path.resolve().parent
    for _ in package.split("."):
        folder = folder.parent
    return folder


def load_module(path: Path, package: str | None = None, name: str | None = None) -> types.ModuleType:
    """Import a model file by path, inside its package so relative imports work."""
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"no such file: {path}")
    forced = package is not None
    package = package if forced else package_of(path)
    if package:
        _import_package(path, package, forced)
    if name is None:
        name = _module_name(path, package)
    existing = sys.modules.get(name)
    if existing is not None and _same_file(getattr(existing, "__file__", None), path):
        return existing
    loader = _CodeCachingLoader(name, str(path)) if path.suffix == ".py" else None
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    if spec is None or spec.loader is None:
        raise BadInput(f"cannot import {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    # A loose file imports its siblings (`from hunyuan_moe import ...`), as `python FILE` allows.
    folder = None if package else str(path.resolve().parent)
    if folder is not None:
        sys.path.insert(0, folder)
    try:
        with kept_registrations():
            spec.loader.exec_module(module)
    except BaseException as exc:
        sys.modules.pop(name, None)
        if isinstance(exc, KeyboardInterrupt):
            raise
        reason = str(exc) if isinstance(exc, BadInput) else one_line(exc)
        raise BadInput(f"cannot import {path}: {reason}") from None
    finally:
        if folder is not None and folder in sys.path:
            sys.path.remove(folder)
    return module


class _CodeCachingLoader(importlib.machinery.SourceFileLoader):
    """The file's loader, with its compiled code kept for the same path and the same bytes:
    verify loads the edited file afresh for every run (about 20 per verify, a fresh module each so
    module-level state belongs to that run's runtime), and with no byte-code cache to read
    (PYTHONDONTWRITEBYTECODE=1, say) each load compiled it again. The code object is immutable
    and the module is still executed afresh each time; a changed file has other bytes and is
    compiled anew."""

    def source_to_code(self, data, path, *, _optimize=-1):  # type: ignore[override]  # typeshed: a staticmethod
        key = (path, bytes(data), _optimize)
        code = _CODE.get(key)
        if code is None:
            code = super().source_to_code(data, path, _optimize=_optimize)
            if len(_CODE) >= _CODE_ENTRIES:
                _CODE.pop(next(iter(_CODE)))
            _CODE[key] = code
        return code


_CODE: dict[tuple[Any, bytes, int], types.CodeType] = {}
_CODE_ENTRIES = 64


def _import_package(path: Path, package: str, forced: bool) -> None:
    try:
        importlib.import_module(package)
        return
    except ImportError:
        pass
    except Exception as exc:
        raise BadInput(f"cannot import package {package}: {one_line(exc)}") from None
    if forced:
        raise BadInput(f"cannot import package {package} for {path}")
    sys.path.insert(0, str(_package_root(path, package)))
    try:
        importlib.import_module(package)
    except Exception as exc:
        raise BadInput(f"cannot import package {package}: {one_line(exc)}") from None


def _module_name(path: Path, package: str | None) -> str:
    stem = path.stem
    canonical = f"{package}.{stem}" if package else stem
    existing = sys.modules.get(canonical)
    if existing is None or _same_file(getattr(existing, "__file__", None), path):
        if existing is None and not package:
            # A loose file whose name clashes with an installed module gets its own name.
            if importlib.util.find_spec(stem) is not None:
                return f"_msrewrite_{stem}_{next(_unique)}"
        return canonical
    return f"{canonical}__msrewrite_{next(_unique)}"


def _same_file(a: str | None, b: Path) -> bool:
    return a is not None and Path(a).resolve() == Path(b).resolve()


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:300]


# Building ------------------------------------------------------------------------------------
def build_harness(
    path: Path,
    *,
    harness: str | None = None,
    target: str | None = None,
    input_shape: tuple[int, ...] | None = None,
    package: str | None = None,
    seed: int = 0,
) -> Harness:
    """Build the module to analyze or verify, with random weights, eval mode, float32."""
    path = Path(path)
    model_module = load_module(path, package=package)
    manual_seed(seed)
    if harness:
        built = _from_user_harness(harness, path, target)
    elif input_shape is not None:
        built = _from_plain_module(model_module, target, input_shape)
    elif (config_cls := _config_class(model_module, path)) is not None:
        built = _from_transformers(model_module, path, target, config_cls)
    else:
        raise BadInput(
            f"{path.name}: no config class found; pass --harness H.py:make or --input-shape for an nn.Module"
        )
    built.seed = seed
    return built


def _from_user_harness(spec: str, model_path: Path, target: str | None) -> Harness:
    file_text, sep, func_name = spec.rpartition(":")
    if not sep or not file_text or not func_name.isidentifier():
        raise BadInput(f"harness must be FILE.py:function, got {spec!r}")
    harness_path = Path(file_text)
    for folder in (harness_path.resolve().parent, model_path.resolve().parent):
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
    harness_module = load_module(harness_path)
    make = getattr(harness_module, func_name, None)
    if not callable(make):
        raise BadInput(f"{harness_path} has no function {func_name}")
    with _recording_inits() as inits:
        try:
            result = make()
        except Exception as exc:
            raise BadInput(f"{spec} failed: {one_line(exc)}") from None
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.nn.Module)):
        raise BadInput(f"{spec} must return (module, inputs)")
    module, inputs = result
    args, kwargs = _split_inputs(inputs)
    if target and type(module).__name__ != target:
        raise BadInput(f"{spec} built {type(module).__name__}, not {target}")
    init_args, init_kwargs = inits.get(module, ((), {}))
    module.eval()
    return Harness(
        module=module,
        args=args,
        kwargs=kwargs,
        config=getattr(module, "config", None),
        target=type(module).__name__,
        init_args=init_args,
        init_kwargs=init_kwargs,
        source="harness",
        make_file=harness_path,
        make_name=func_name,
        # the module the harness took the class from: re-run, it is given the other file in its place
        model_name="" if _same_file(str(harness_path), model_path) else type(module).__module__,
    )


def _split_inputs(inputs: Any) -> tuple[tuple, dict]:
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, (tuple, list)):
        if len(inputs) == 2 and isinstance(inputs[0], (tuple, list)) and isinstance(inputs[1], dict):
            return tuple(inputs[0]), dict(inputs[1])
        return tuple(inputs), {}
    raise BadInput("harness inputs must be a tuple, a dict or (args, kwargs)")


def _module_classes(model_module: types.ModuleType) -> dict[str, type[torch.nn.Module]]:
    return {
        name: obj
        for name, obj in vars(model_module).items()
        if isinstance(obj, type) and issubclass(obj, torch.nn.Module) and obj.__module__ == model_module.__name__
    }


def _from_plain_module(model_module: types.ModuleType, target: str | None, input_shape: tuple[int, ...]) -> Harness:
    classes = _module_classes(model_module)
    if target is None:
        if len(classes) != 1:
            raise BadInput(f"the file defines {len(classes)} nn.Module classes; pass --target")
        target = next(iter(classes))
    cls = classes.get(target)
    if cls is None:
        raise BadInput(f"no nn.Module class {target} in the file")
    try:
        module = cls().eval()
    except Exception as exc:
        raise BadInput(f"cannot build {target}() without arguments: {one_line(exc)}; use --harness") from None
    x = torch.randn(*input_shape)
    return Harness(module=module, args=(x,), kwargs={}, config=None, target=target, source="module")


# transformers ---------------------------------------------------------------------------------
_CONFIG_IMPORT = re.compile(r"from\s+\.configuration_\w+\s+import\s+\(?\s*(\w+Config)\b")


def _config_class(model_module: types.ModuleType, path: Path) -> type[object] | None:
    match = _CONFIG_IMPORT.search(path.read_text(encoding="utf-8", errors="replace"))
    if match is None:
        return None
    cls = getattr(model_module, match.group(1), None)
    return cls if isinstance(cls, type) else None


def tiny_config(config_cls: type[object], overrides: dict[str, Any] | None = None) -> Any:
    """The config with tiny dimensions; only fields the class knows are set."""
    known = _config_fields(config_cls)
    values = {k: v for k, v in TINY_CONFIG.items() if k in known}
    if "num_layers" in values:  # LongcatFlash derives num_hidden_layers from num_layers
        values.pop("num_hidden_layers", None)
    if "qk_rope_head_dim" in values and "head_dim" in values:  # MLA: rotary runs on the rope part only
        values["head_dim"] = values["qk_rope_head_dim"]
    values.update(overrides or {})
    # A model may reject one of the generic tiny values (DeepSeek-V4's layer_types, say): drop the
    # values its error names, falling back to that model's own default, and try again.
    for _attempt in range(len(values) + 1):
        try:
            config = config_cls(**values)
            break
        except Exception as exc:
            message = str(exc)
            named = [k for k in values if k not in (overrides or {}) and re.search(rf"\b{k}\b", message)]
            if not named:
                raise BadInput(f"cannot build a tiny {config_cls.__name__}: {one_line(exc)}") from None
            for key in named:
                values.pop(key)
    # Pin the implementations: the tiny run and the full-size estimate must trace the same code.
    if hasattr(config, "_attn_implementation"):
        config._attn_implementation = "sdpa"
    if getattr(config, "_experts_implementation", None) is None and hasattr(config, "_experts_implementation"):
        config._experts_implementation = "eager"
    return config


def _config_fields(config_cls: type[object]) -> set[str]:
    import dataclasses

    names: set[str] = set()
    if dataclasses.is_dataclass(config_cls):
        names |= {f.name for f in dataclasses.fields(config_cls)}
    names |= set(inspect.signature(config_cls.__init__).parameters)
    names |= set(getattr(config_cls, "attribute_map", {}) or {})
    return names


def default_target(classes: dict[str, type[torch.nn.Module]]) -> str:
    layers = [name for name in classes if name.endswith("DecoderLayer")]
    if not layers:
        raise BadInput("no decoder layer class in the file; pass --target")
    return layers[0]


def moe_layer_index(config: Any) -> int:
    """The last layer: MoE in every tiny config (first_k_dense_replace=1, layer_types[1] full attention)."""
    layers: Any = getattr(config, "num_layers", None) or getattr(config, "num_hidden_layers", 1)
    return max(0, int(layers) - 1)


def _from_transformers(
    model_module: types.ModuleType, path: Path, target: str | None, config_cls: type[object]
) -> Harness:
    classes = _module_classes(model_module)
    config = tiny_config(config_cls)
    target = target or default_target(classes)
    cls = classes.get(target)
    if cls is None:
        raise BadInput(f"no nn.Module class {target} in {path.name}")
    init_args: tuple = (config,)
    init_kwargs: dict = {}
    if "layer_idx" in inspect.signature(cls.__init__).parameters:
        init_kwargs["layer_idx"] = moe_layer_index(config)
    try:
        module = cls(*init_args, **init_kwargs).to(torch.float32).eval()
    except Exception as exc:
        raise BadInput(f"cannot build {target} from a tiny config: {one_line(exc)}") from None
    init_custom_parameters(module, getattr(config, "initializer_range", 0.02))
    hidden_states = torch.randn(1, TOKENS, config.hidden_size)
    kwargs = _layer_kwargs(cls, classes, config, hidden_states)
    return Harness(
        module=module,
        args=(hidden_states,),
        kwargs=kwargs,
        config=config,
        target=target,
        init_args=init_args,
        init_kwargs=init_kwargs,
        source="transformers",
    )


def _layer_kwargs(
    cls: type[torch.nn.Module], classes: dict[str, type[torch.nn.Module]], config: Any, hidden_states: torch.Tensor
) -> dict:
    """Decoder layers need position embeddings from the model's rotary class; MoE blocks need nothing."""
    params = inspect.signature(inspect.unwrap(cls.forward)).parameters
    if "position_embeddings" not in params:
        return {}
    rotary = next((c for name, c in classes.items() if name.endswith("RotaryEmbedding")), None)
    if rotary is None:
        raise BadInput(f"{cls.__name__} needs position embeddings but the file has no rotary embedding class")
    position_ids = torch.arange(hidden_states.shape[1]).unsqueeze(0)
    with torch.no_grad():
        cos, sin = rotary(config=config)(hidden_states, position_ids)
    kwargs: dict = {"position_embeddings": (cos, sin), "attention_mask": None}
    if "position_ids" in params:
        kwargs["position_ids"] = position_ids
    return kwargs


# Helpers ---------------------------------------------------------------------------------------
def init_custom_parameters(module: torch.nn.Module, std: float) -> None:
    """Give a value to parameters of non-torch.nn modules.

    transformers creates expert and router weights with torch.empty and fills them only in
    PreTrainedModel.post_init, which a bare layer never runs: their memory is garbage (NaN at times).
    """
    with torch.no_grad():
        for sub in module.modules():
            if type(sub).__module__.startswith("torch.nn"):
                continue
            for name, param in sub.named_parameters(recurse=False):
                if param.dim() >= 2:
                    param.normal_(0.0, std)
                elif "bias" in name:
                    param.zero_()
                else:
                    param.fill_(1.0)


def manual_seed(seed: int) -> None:
    """torch.manual_seed for a CPU run: the CPU generator, and CUDA's once CUDA is initialized.
    torch.manual_seed also queues a seed for each device not initialized yet, each with the
    whole Python stack (traceback.format_stack): a tenth of a small model's verify. A device
    first initialized during a run gets its own fixed default seed, the same in every run."""
    torch.random.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


def clone_tree(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple):
        return tuple(clone_tree(v) for v in value)
    if isinstance(value, list):
        return [clone_tree(v) for v in value]
    if isinstance(value, dict):
        return {k: clone_tree(v) for k, v in value.items()}
    return value


class _InitRecord:
    """Constructor arguments of every nn.Module built while recording, by object."""

    def __init__(self) -> None:
        self._calls: dict[int, tuple[weakref.ref, tuple, dict]] = {}

    def note(self, obj: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        old = self._calls.get(id(obj))
        if old is None or old[0]() is not obj:  # keep the outermost __init__ call per live object
            self._calls[id(obj)] = (weakref.ref(obj), args, kwargs)

    def get(self, obj: torch.nn.Module, default: Any) -> Any:
        entry = self._calls.get(id(obj))
        return (entry[1], entry[2]) if entry and entry[0]() is obj else default


@contextmanager
def _recording_inits() -> Iterator[_InitRecord]:
    """Record the arguments of nn.Module constructors via a profile hook on `__init__` calls."""
    record = _InitRecord()

    def profile(frame: types.FrameType, event: str, _arg: Any) -> None:
        if event != "call" or frame.f_code.co_name != "__init__":
            return
        obj = frame.f_locals.get("self")
        if isinstance(obj, torch.nn.Module):
            record.note(obj, *_call_arguments(frame))

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield record
    finally:
        sys.setprofile(previous)


def _call_arguments(frame: types.FrameType) -> tuple[tuple, dict]:
    info = inspect.getargvalues(frame)
    code = frame.f_code
    positional = [info.locals[name] for name in info.args[1 : code.co_argcount]]  # skip self
    kwonly = code.co_varnames[code.co_argcount : code.co_argcount + code.co_kwonlyargcount]
    kwargs = {name: info.locals[name] for name in kwonly}
    if info.varargs:
        positional += list(info.locals[info.varargs])
    if info.keywords:
        kwargs.update(info.locals[info.keywords])
    return tuple(positional), kwargs


# Isolation -------------------------------------------------------------------------------------
class ChildFailed(Exception):
    """The child running user code died, hung or exited before it reported (`phase`: where)."""

    def __init__(self, message: str, phase: str) -> None:
        super().__init__(message)
        self.phase = phase


_child_pid: int | None = None  # set in the child run_in_child made


def exit_if_forked() -> None:
    """Called after each forward: a process that user code forked inside the child ends here,
    silently, instead of running (and forking) on and reporting twice."""
    if _child_pid is not None and os.getpid() != _child_pid:
        os._exit(0)


class ChildProgress:
    """Handed to the function run in the child: `progress.phase("running the model")` says where
    user code is, so a death or a hang can be blamed on the harness or on the model."""

    def __init__(self, fd: int, pid: int) -> None:
        self._fd, self._pid = fd, pid

    def phase(self, name: str) -> None:
        exit_if_forked()
        _send(self._fd, ("phase", name))

    def stage(self, name: str) -> None:
        """A step worth showing a person watching (run_in_child's `on_stage`); blames nothing."""
        exit_if_forked()
        _send(self._fd, ("stage", name))


def _send(fd: int, message: Any) -> None:
    data = pickle.dumps(message)
    os.write(fd, len(data).to_bytes(8, "little"))
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def run_in_child(
    fn: Callable[[ChildProgress], Any],
    *,
    timeout: float,
    stdout_to_stderr: bool = True,
    on_stage: Callable[[str], None] | None = None,
) -> Any:
    """`fn(progress)` in a forked child process; its return value (pickled) or its MsrewriteError.

    User code (a harness, a model import, a forward) can exit, `os._exit`, die of a signal, hang or
    print: the child's stdout goes to stderr (so `--json` output stays clean), a process the user
    code forks never reports, and the whole child process group is killed after `timeout` seconds.
    Raises ChildFailed with a one-line reason naming the phase.

    Whatever way this ends (an outcome, a timeout, the child killed, Ctrl-C, SIGTERM or SIGHUP
    here) the child's group is killed and reaped and its scratch folder (scratch_folder) removed:
    a killed child runs no cleanup of its own, so the parent owns every folder it makes."""
    import shutil
    import tempfile

    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    scratch = tempfile.mkdtemp(prefix="msrewrite-child-")
    pid, reaped = None, False
    try:
        with _signals_raise_interrupt():
            read_fd, write_fd = os.pipe()
            try:
                # no signal may land between fork and setting pid (here) or the child's own handlers
                old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOPPING)
                try:
                    pid = os.fork()
                finally:
                    if pid != 0:
                        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
                if pid == 0:
                    _child_main(fn, read_fd, write_fd, stdout_to_stderr, scratch)
            finally:
                os.close(write_fd)
            try:
                result, phase = _read_reports(pid, read_fd, timeout, on_stage)
            finally:
                os.close(read_fd)
            _, status = os.waitpid(pid, 0)
            reaped = True
    finally:
        if pid is not None:
            _kill_group(pid, reap=not reaped)  # anything user code left running in the child's group
        shutil.rmtree(scratch, ignore_errors=True)
    return _child_outcome(result, status, phase)


@contextmanager
def _signals_raise_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP raise KeyboardInterrupt while the child runs, as Ctrl-C does, so the
    child is killed and its folders removed before this process ends."""

    def interrupt(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {}
    try:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, interrupt)
    except ValueError:  # not the main thread: signals stay as they are
        pass
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


_STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


_child_scratch: str | None = None  # in a child run_in_child made: the folder its parent removes


def scratch_folder(prefix: str) -> contextlib.AbstractContextManager[str]:
    """A temporary folder for user-code work: inside the child's scratch folder when run in a
    child (removed by the parent even when the child is killed), else a plain temporary one."""
    import tempfile

    return tempfile.TemporaryDirectory(prefix=prefix, dir=_child_scratch)


def _child_main(
    fn: Callable[[ChildProgress], Any], read_fd: int, write_fd: int, stdout_to_stderr: bool, scratch: str
) -> NoReturn:
    """The forked child: run `fn`, send its outcome to the parent, and end without returning."""
    global _child_pid, _child_scratch
    code = 0
    try:
        os.close(read_fd)
        os.setpgid(0, 0)
        for sig in (signal.SIGTERM, signal.SIGHUP):  # the parent's handlers (run_in_child): not here
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPPING)  # blocked around the fork (none pending here)
        gc.enable()  # off in the msrewrite process (cli.entry); user code may make cycles
        if stdout_to_stderr:
            os.dup2(2, 1)
        me = os.getpid()
        _child_pid = me
        _child_scratch = scratch
        progress = ChildProgress(write_fd, me)
        try:
            value = ("ok", fn(progress))
        except MsrewriteError as exc:
            value = ("error", exc)
        except SystemExit as exc:
            value = ("exit", f"called sys.exit({exc.code!r})")
        except BaseException as exc:  # noqa: BLE001 - reported to the parent as one line
            value = ("crash", one_line(exc))
        if os.getpid() == me:  # a process forked by user code never reports
            sys.stdout.flush()
            _send(write_fd, value)
    except BaseException:  # noqa: BLE001
        code = 70
    finally:
        os._exit(code)


_UNREADABLE = object()  # a report this process cannot unpickle


def _read_reports(
    pid: int, read_fd: int, timeout: float, on_stage: Callable[[str], None] | None
) -> tuple[tuple[str, Any] | None, str]:
    """The child's reports up to its outcome: (outcome, or None when the pipe closed first; the
    phase it last named). A timeout or an unreadable report kills the child's group."""
    phase = "starting"
    deadline = time.monotonic() + timeout
    buffer = b""
    result: tuple[str, Any] | None = None
    while result is None:
        left = deadline - time.monotonic()
        if left <= 0:
            _kill_group(pid)
            raise ChildFailed(f"timed out after {timeout:g} s while {phase}", phase)
        ready, _, _ = select.select([read_fd], [], [], min(left, 1.0))
        if not ready:
            continue
        chunk = os.read(read_fd, 1 << 20)
        if not chunk:
            break
        messages, buffer = _split_reports(buffer + chunk)
        for kind, value in messages:
            if kind is _UNREADABLE:  # e.g. an object of a class only the child imported
                _kill_group(pid)
                raise ChildFailed(f"returned a result this process cannot read ({one_line(value)})", phase)
            if kind == "phase":
                phase = value
            elif kind == "stage":
                if on_stage is not None:
                    on_stage(value)
            else:
                result = (kind, value)
        # after the outcome, stop: a process user code forked may still hold the pipe open
    return result, phase


def _split_reports(buffer: bytes) -> tuple[list[tuple[Any, Any]], bytes]:
    """The complete (kind, value) reports at the start of `buffer` (8-byte length, pickle), and
    what is left; one that does not load ends the list as (_UNREADABLE, the exception)."""
    found: list[tuple[Any, Any]] = []
    while len(buffer) >= 8 and len(buffer) >= 8 + int.from_bytes(buffer[:8], "little"):
        size = int.from_bytes(buffer[:8], "little")
        try:
            kind, value = pickle.loads(buffer[8 : 8 + size])
        except Exception as exc:  # noqa: BLE001
            found.append((_UNREADABLE, exc))
            break
        found.append((kind, value))
        buffer = buffer[8 + size :]
    return found, buffer


def _child_outcome(result: tuple[str, Any] | None, status: int, phase: str) -> Any:
    """The child's return value, or its error raised here."""
    if result is None:
        if os.WIFSIGNALED(status):
            name = signal.Signals(os.WTERMSIG(status)).name
            raise ChildFailed(f"killed by {name} while {phase}", phase)
        raise ChildFailed(f"exited with status {os.WEXITSTATUS(status)} while {phase} (os._exit in user code?)", phase)
    kind, value = result
    if kind == "ok":
        return value
    if kind == "error":
        raise value
    if kind == "exit":
        raise ChildFailed(f"{value} while {phase}", phase)
    raise ChildFailed(f"crashed while {phase}: {value}", phase)


def _kill_group(pid: int, reap: bool = False) -> None:
    """SIGKILL the child's process group; `reap`: wait for the child itself (not yet waited for)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)  # a child stopped before its setpgid has no group yet
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0 if reap else os.WNOHANG)
