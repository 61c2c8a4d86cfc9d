"""Triton kernels for the GPU path (also run on CPU under `TRITON_INTERPRET=1` in tests).

Each module holds one kernel family and its Python wrapper; `backend.py` wires them behind the attention
seam of `kernels/api.py`. Importing this package imports triton; `import kernels` never does.
"""
