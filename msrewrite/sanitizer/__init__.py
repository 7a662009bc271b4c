"""A stream sanitizer for multi-stream model code running on the CPU stand-ins.

with install() as rt:
    with Sanitizer(rt, user_files=[model_file]) as san:
        san.check_output(model(x))
    san.findings
"""

from msrewrite.sanitizer.findings import KINDS, Finding
from msrewrite.sanitizer.sanitizer import Sanitizer
from msrewrite.sanitizer.static import static_mixed_api

__all__ = ["KINDS", "Finding", "Sanitizer", "static_mixed_api"]
