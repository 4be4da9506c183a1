"""Let this environment see another one's packages, after its own (``make setup-oldest``).

    .venv-oldest/bin/python tools/share_venv.py .venv

Writes ``kvlab-shared-venv.pth`` into this environment's site-packages: at start-up Python adds
the other environment's site-packages (``site.addsitedir``, so its own ``.pth`` files run too,
kvlab's editable install among them) *after* this environment's own. A package installed here
(the oldest supported Triton) wins over the other's copy; everything else (torch, NumPy,
Jupyter, the test tools) comes from the other environment, so nothing is installed twice.
"""
from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

PTH = "kvlab-shared-venv.pth"


def share(other: Path) -> Path:
    here = Path(sysconfig.get_paths()["purelib"])
    theirs = Path(other).resolve() / here.relative_to(sys.prefix)
    if not theirs.is_dir():
        raise SystemExit(f"share_venv: {theirs} is not a folder: is {other} a virtual "
                         f"environment of the same Python ({sys.version.split()[0]})?")
    path = here / PTH
    path.write_text(f"import site; site.addsitedir({str(theirs)!r})\n")
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__.split("\n\n")[1].strip())
    share(Path(sys.argv[1]))
