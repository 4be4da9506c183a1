"""``python -m kvlab.course.scenes [OUT_DIR] [ONLY]``: draw the chapters' figures (``make figures``)."""
import argparse

from .render import render_all

parser = argparse.ArgumentParser(
    prog="python -m kvlab.course.scenes",
    description="Draw every figure of the chapters' scenes into OUT_DIR (default figures/).")
parser.add_argument("out_dir", nargs="?", default="figures", help="where the PNGs go")
parser.add_argument("only", nargs="?", default=None,
                    help="only the figures whose file name contains this")
args = parser.parse_args()
render_all(args.out_dir, args.only)
