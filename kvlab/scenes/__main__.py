import sys

from .render import render_all

render_all(sys.argv[1] if len(sys.argv) > 1 else "figures", sys.argv[2] if len(sys.argv) > 2 else None)
