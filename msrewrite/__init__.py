"""msrewrite: insert multi-stream overlaps into PyTorch model code.

Pipeline: load -> analyze -> plan -> emit -> output -> verify.
"""

__version__ = "0.1.0"
