"""CPU stand-ins for the stream APIs msrewrite emits (torch.npu, torch_npu, torchair, torch.cuda).

with install() as rt:
    ...  # multi-stream model code runs on CPU; rt.record_ops() / rt.graph_mode()
"""

from msrewrite.runtime.active import active_runtime
from msrewrite.runtime.core import RuntimeListener, StreamRuntime
from msrewrite.runtime.install import install
from msrewrite.runtime.recording import OpRecord
from msrewrite.runtime.streams import CudaStream, Event, Stream, StreamContext

__all__ = [
    "CudaStream",
    "Event",
    "OpRecord",
    "RuntimeListener",
    "Stream",
    "StreamContext",
    "StreamRuntime",
    "active_runtime",
    "install",
]
