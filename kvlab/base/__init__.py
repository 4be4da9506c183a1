"""The base every subsystem stands on: errors, argument rules, the runtime, Triton's launch path.

* :mod:`~kvlab.base.errors` -- ``InvalidArgument``, ``OutOfPages``, ``CacheMisuse``,
  ``IntegrityError``: the error types every public call raises;
* :mod:`~kvlab.base.args` -- the argument rules every public door checks (``check_int``,
  ``check_page_size``, ``div_ceil``, ...);
* :mod:`~kvlab.base.runtime` -- compiled Triton on a GPU or Triton's interpreter on the CPU,
  decided before any kernel is defined (chapter 00), with :mod:`~kvlab.base.gpus` (the GPUs
  the course runs on) and :mod:`~kvlab.base.triton_compat` (known interpreter breakages, mended);
* :mod:`~kvlab.base.launch` -- kernels kept compiled and launched through Triton's C
  launcher (chapter 09);
* :mod:`~kvlab.base.lazy` -- how each subsystem's names load on first use.

Nothing here imports a subsystem above it.
"""
from __future__ import annotations

from .lazy import lazy_exports

_EXPORTS = {
    "KvlabError": "errors", "InvalidArgument": "errors", "OutOfPages": "errors",
    "CacheMisuse": "errors", "IntegrityError": "errors",
    "div_ceil": "args",
    "DEVICE": "runtime", "INTERPRET": "runtime", "pick": "runtime", "half_dtype": "runtime",
    "half_note": "runtime", "runtime_report": "runtime",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS,
                                    ("errors", "args", "runtime", "gpus", "triton_compat", "launch", "lazy"))
