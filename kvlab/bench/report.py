"""Writing a benchmark result: ``bench.json``, ``bench.md`` (tables, targets) and the plots."""
from __future__ import annotations

import json
import os

from .suite import round_ratios


def _us(entry: dict | None) -> str:
    if not entry:
        return "–"
    if "median_us" in entry:
        return f"{entry['median_us']:.1f}"
    if "skipped" in entry:
        return "skipped"
    return "–"


def _ratio(row: dict, num: str, den: str, metric: str = "median_us") -> str:
    a, b = row["paths"].get(num, {}), row["paths"].get(den, {})
    if metric in a and metric in b and b[metric] > 0:
        return f"{a[metric] / b[metric]:.2f}"
    return "–"


def _round_ratios(row: dict, num: str, den: str) -> str:
    """`` (0.55–0.70)``: the range of the per-round ratios; a wide one means a noisy host."""
    ratios = round_ratios(row, num, den)
    return f" ({min(ratios):.2f}–{max(ratios):.2f})" if ratios else ""


def _loop(entry: dict | None) -> str:
    return f"{entry['loop_us']:.1f}" if entry and "loop_us" in entry else "–"


def markdown(res: dict) -> str:
    m = res["meta"]
    lines = [f"# kvlab.bench — {m['device']}", "",
             f"{m['note']}.", "",
             f"torch {m['torch']}, triton {m['triton']}, python {m['python']}; timer: {m['timer']}; "
             f"{m['date']}; {m.get('seconds', '?')} s.", ""]
    if res.get("smoke"):
        lines += ["**Smoke run: these numbers are not timings and make no claim.**", ""]
    lines += ["Paths of one case are timed side by side: the per-call-in-a-loop rounds of all its paths "
              "are interleaved in a rotating order, and each path's number is its median over the rounds. "
              "**A ratio x/y is the quotient of those two medians**; in brackets, the range of the per-round "
              "ratios (round i of x over round i of y, timed next to each other).", ""]

    lines += ["## Targets", "", "| target | rule | measured | result |", "|---|---|---|---|"]
    for t in res["targets"]:
        verdict = "n/a (smoke)" if t["passed"] is None else ("PASS" if t["passed"] else "FAIL")
        lines.append(f"| {t['name']} | {t['rule']} | {t['measured']} | **{verdict}** |")

    lines += ["", "## alloc_extend (µs per call: do_bench median / per call in a loop)", "",
              "| case | P | tokens | teaching | fast | fast/teaching | fast (host lens) | fast (1 sync) | torch | agree |",
              "|---|---|---|---|---|---|---|---|---|---|"]

    def both(e):
        return f"{_us(e)} / {_loop(e)}"

    for r in res["extend"]:
        p = r["paths"]
        lines.append(f"| {r['case']} | {r['page_size']} | {r['tokens']} | {both(p.get('teaching'))} | "
                     f"{both(p.get('fast'))} | {_ratio(r, 'fast', 'teaching')} / {_ratio(r, 'fast', 'teaching', 'loop_us')}"
                     f"{_round_ratios(r, 'fast', 'teaching')} | "
                     f"{both(p.get('fast_host_lens'))} | {both(p.get('fast_sync'))} | {both(p.get('torch'))} | "
                     f"{'yes' if r.get('agree') else 'NO'} |")
    skipped = {r["paths"]["teaching"]["skipped"] for r in res["extend"]
               if "skipped" in r["paths"].get("teaching", {})}
    for s in sorted(skipped):
        lines.append(f"\nteaching skipped: {s}.")

    lines += ["", "**do_bench median**: `triton.testing.do_bench`, L2 flushed (a 256 MB memset) before each call; "
              "for a path without a host sync it can hide host time behind that memset. **per call in a loop**: "
              "back-to-back calls between two CUDA events (host launch overhead and syncs included), the paths "
              "of the case interleaved round by round, each path's median over its rounds. The targets use "
              "the loop numbers."]
    if res.get("fast_compiles"):
        lines += ["", "## The fast path's compilations (once per page size and kernel variant)", "",
                  "| P | bs | tokens | first call, ms |", "|---|---|---|---|"]
        for c in res["fast_compiles"]:
            lines.append(f"| {c['page_size']} | {c['bs']} | {c['tokens']} | {c['fast_first_call_ms']:.0f} |")
    lines += ["", "## First call on a shape not seen before (ms, fresh process)", "",
              "| case | P | tokens | teaching lanes | teaching | fast | fast compiled before? |",
              "|---|---|---|---|---|---|---|"]
    for r in res["cold"]:
        t = r["teaching_first_call_ms"]
        tt = f"{t:.1f}" if t is not None else f"skipped: {r.get('teaching_skipped', '')}"
        lines.append(f"| {r['case']} | {r['page_size']} | {r['tokens']} | {r['teaching_lanes']} | {tt} | "
                     f"{r['fast_first_call_ms']:.2f} | {'yes' if r['fast_compiled_before'] else 'no (compiles)'} |")

    lines += ["", "## alloc_decode (µs per step: do_bench median / per call in a loop)", "",
              "| bs | P | new pages | teaching | fast | fast/teaching | fast (1 sync) | torch | agree |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in res["decode"]:
        p = r["paths"]
        lines.append(f"| {r['bs']} | {r['page_size']} | {r['new_pages']} | {both(p.get('teaching'))} | "
                     f"{both(p.get('fast'))} | {_ratio(r, 'fast', 'teaching')} / {_ratio(r, 'fast', 'teaching', 'loop_us')}"
                     f"{_round_ratios(r, 'fast', 'teaching')} | "
                     f"{both(p.get('fast_sync'))} | {both(p.get('torch'))} | {'yes' if r.get('agree') else 'NO'} |")

    lines += ["", "## Page-table write (µs per write: do_bench median / per call in a loop)", ""]
    if res["page_table"] and "error" in res["page_table"][0]:
        lines.append(res["page_table"][0]["error"])
    else:
        lines += ["| case | P | slots | host loop | Triton | host loop / Triton | agree |", "|---|---|---|---|---|---|---|"]
        for r in res["page_table"]:
            lines.append(f"| {r['case']} | {r['page_size']} | {r['slots']} | {both(r['paths']['host_loop'])} | "
                         f"{both(r['paths']['triton'])} | {_ratio(r, 'host_loop', 'triton')} / "
                         f"{_ratio(r, 'host_loop', 'triton', 'loop_us')}{_round_ratios(r, 'host_loop', 'triton')} | "
                         f"{'yes' if r.get('agree') else 'NO'} |")

    lines += ["", f"## Prefix sums: fixed {res['config']['scaling_tokens']} tokens, growing batch (median µs)", "",
              "| bs | teaching | fast |", "|---|---|---|"]
    for r in res["scaling"]:
        lines.append(f"| {r['bs']} | {both(r['paths']['teaching'])} | {both(r['paths']['fast'])} |")
    return "\n".join(lines) + "\n"


def write_outputs(res: dict, out_dir: str, log=print) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .plots import PLOTS

    os.makedirs(out_dir, exist_ok=True)
    written = []
    path = os.path.join(out_dir, "bench.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    written.append(path)
    path = os.path.join(out_dir, "bench.md")
    with open(path, "w") as f:
        f.write(markdown(res))
    written.append(path)
    for name, plot in PLOTS.items():
        fig = plot(res)
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
        plt.close(fig)
        written.append(path)
    for p in written:
        log(f"wrote {p}")
    return written


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)
