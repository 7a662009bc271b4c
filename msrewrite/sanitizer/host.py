"""Host reads the dispatcher never sees on CPU, handed to the sanitizer by a TorchFunctionMode.

On a device `t.cpu()`, `t.to("cpu")`, `t.tolist()`, `t.numpy()`, `np.asarray(t)` and `print(t)` copy
`t` to the host on the current stream (`.item()`, `bool(t)`, `int(t)` too, but those dispatch
`aten._local_scalar_dense` on CPU and are seen as ops). On CPU `.cpu()` and `.to("cpu")` return
`t` itself with no op, and the others read its memory directly, so a TorchDispatchMode never sees
them. `HostReads`, a TorchFunctionMode entered with the sanitizer, hands them to it.

`.cpu()` and `.to(<host>)` of a device tensor return a copy made by an aten `_to_copy` under the
sanitizer, as on a device: its later accesses are accesses of a host tensor, not of `t`. "Host"
is the string "cpu", a `torch.device("cpu")` made inside the sanitized block, or the device of a
tensor copied to the host there. Any other cpu device (`x.device`) is taken for the model's
device, on which `.to(x.device)` is no copy at all: on CPU the two cannot be told apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode

if TYPE_CHECKING:
    from msrewrite.sanitizer.sanitizer import Sanitizer


class HostReads(TorchFunctionMode):
    def __init__(self, sanitizer: Sanitizer) -> None:
        super().__init__()
        self.sanitizer = sanitizer
        self._host_devices: dict[int, torch.device] = {}  # id -> the torch.device("cpu") made in the block
        self._handlers = {
            torch.Tensor.cpu: self._cpu,
            torch.Tensor.to: self._to,
            torch.Tensor.tolist: self._read,
            torch.Tensor.numpy: self._read,
            torch.Tensor.__array__: self._read,
            torch.Tensor.__repr__: self._read,
            torch.Tensor.__format__: self._read,
            torch.device: self._device,
        }

    def __torch_function__(self, func, types, args=(), kwargs=None):
        handler = self._handlers.get(func)
        if handler is None:
            return func(*args, **(kwargs or {}))
        return handler(func, args, kwargs or {})

    def __exit__(self, *exc) -> None:
        self._host_devices.clear()
        super().__exit__(*exc)

    # --- handlers ----------------------------------------------------------------------
    def _read(self, func, args, kwargs):
        if args and isinstance(args[0], torch.Tensor):
            self.sanitizer.on_host_read(args[0])
        return func(*args, **kwargs)

    def _cpu(self, func, args, kwargs):
        tensor = args[0]
        if not self._on_device(tensor):
            return func(*args, **kwargs)
        memory_format = kwargs.get("memory_format", args[1] if len(args) > 1 else torch.preserve_format)
        return self._to_host(tensor, None, False, memory_format)

    def _to(self, func, args, kwargs):
        tensor, rest = args[0], args[1:]
        if not self._is_host(rest[0] if rest else kwargs.get("device")) or not self._on_device(tensor):
            return func(*args, **kwargs)
        try:
            _, dtype, non_blocking, memory_format = torch._C._nn._parse_to(
                *rest, **{k: v for k, v in kwargs.items() if k != "copy"}
            )
        except (TypeError, RuntimeError):
            return func(*args, **kwargs)  # torch's own error
        return self._to_host(tensor, dtype, non_blocking, memory_format)

    def _device(self, func, args, kwargs):
        device = func(*args, **kwargs)
        named = args[0] if args else kwargs.get("type")
        if device.type == "cpu" and (isinstance(named, str) or self._is_host(named)):
            self._host_devices[id(device)] = device  # kept, so that its id is not reused
        return device

    # --- helpers -----------------------------------------------------------------------
    def _to_host(self, tensor: torch.Tensor, dtype, non_blocking: bool, memory_format) -> torch.Tensor:
        """The copy a device makes: `_to_copy` reads `tensor` on the current stream."""
        copy = torch.Tensor.to(
            tensor,
            "cpu",
            dtype=dtype if dtype is not None else tensor.dtype,
            non_blocking=non_blocking,
            copy=True,
            memory_format=memory_format if memory_format is not None else torch.preserve_format,
        )
        self.sanitizer.on_host_copy(copy, non_blocking)
        return copy

    def _on_device(self, tensor: Any) -> bool:
        """A tensor standing in for device memory: on CPU, and not a copy made to the host."""
        return isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" and not self.sanitizer.is_host(tensor)

    def _is_host(self, target: Any) -> bool:
        if isinstance(target, str):
            try:
                return torch.device(target).type == "cpu"
            except RuntimeError:
                return False
        if isinstance(target, torch.device):
            return id(target) in self._host_devices
        if isinstance(target, torch.Tensor):
            return self.sanitizer.is_host(target)
        return False
