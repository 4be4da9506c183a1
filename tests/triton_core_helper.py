"""A Triton jit helper whose module sees only ``triton.language.core`` (never ``triton.language``):
tests/test_triton_compat.py launches it from a kernel whose launch patches ``triton.language``
alone, to check that the interpreter still patches the helper's own language module.
It lives in a file of its own because Triton's compiler reads a jit function's source file."""
import triton
from triton.language import core


@triton.jit
def plus_three(x):
    return x + core.full((8,), 3, core.int64)
