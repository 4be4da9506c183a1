"""Writing a benchmark result: ``bench.json``, ``bench.md`` (tables, targets) and the plots."""
from __future__ import annotations

import json
import os

from .decode_report import attention_section
from .memory_report import memory_section
from .serve_report import serve_section
from .timing import round_ratios


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
    extra = ""
    if res.get("attention"):
        extra += "\n".join(attention_section(res["attention"])) + "\n"
    if res.get("serve"):
        extra += "\n".join(serve_section(res["serve"])) + "\n"
    if res.get("memory"):
        extra += "\n".join(memory_section(res["memory"])) + "\n"
    if "meta" not in res:            # a serving, attention or memory benchmark alone
        return "# kvlab.bench\n" + extra
    return _suite_markdown(res) + extra


def _suite_markdown(res: dict) -> str:
    m = res["meta"]
    lines = [f"# kvlab.bench — {m['device']}", "",
             f"{m['note']}.", "",
             f"torch {m['torch']}, triton {m['triton']}, python {m['python']}; timer: {m['timer']}; "
             f"{m['date']}; {m.get('seconds', '?')} s.", "",
             f"Produced by: `{m.get('command', 'python -m kvlab.bench')}`", ""]
    if res.get("smoke"):
        lines += ["**Smoke run: these numbers are not timings and make no claim.**", ""]
    lines += ["Paths of one case are timed side by side: the per-call-in-a-loop rounds of all its paths "
              "are interleaved in a rotating order, and each path's number is its median over the rounds. "
              "**A ratio x/y is the quotient of those two medians**; in brackets, the range of the per-round "
              "ratios (round i of x over round i of y, timed next to each other).", ""]

    lines += ["## Targets", "", "| target | rule | limit | measured | result |", "|---|---|---|---|---|"]
    for t in res["targets"]:
        verdict = "n/a (smoke)" if t["passed"] is None else ("PASS" if t["passed"] else "FAIL")
        lines.append(f"| {t['name']} | {t['rule']} | {t.get('limit', '')} | {t['measured']} | **{verdict}** |")
    lines += public_sections(res)

    if not res.get("extend"):
        return "\n".join(lines) + "\n"
    lines += ["", "## Kernels called bare: alloc_extend (µs per call: do_bench median / per call in a loop)", "",
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


def _syncs(entry: dict | None) -> str:
    s = (entry or {}).get("syncs")
    return "–" if s is None else str(s)


def public_sections(res: dict) -> list[str]:
    """The public calls, the floor beside them, the checks' host time, first calls."""
    lines: list[str] = []
    floor = res.get("floor", {}).get("paths", {})
    if floor:
        lines += ["", "## The launch floor (µs per call in a loop, same run)", "",
                  "| empty Triton kernel, `kernel[grid]()` | same, compiled kernel kept (how the allocator "
                  "launches) | kept + one `.item()` | kept + seven `.item()` |", "|---|---|---|---|",
                  f"| {_loop(floor.get('launch'))} | {_loop(floor.get('launch_kept'))} | "
                  f"{_loop(floor.get('launch_1_sync'))} | {_loop(floor.get('launch_7_syncs'))} |"]
    names = ("fast_host_lens", "fast", "teaching_host_lens", "teaching", "seed_wrapper")
    head = ("| fast, host lengths | fast | teaching, host lengths | teaching | seed wrapper | fast / seed "
            "| syncs per call (same order) | agree |")
    for key, title, label in (("public_extend", "alloc_extend", lambda r: f"{r['case']} | {r['page_size']} | "
                               f"{r['tokens']}"),
                              ("public_decode", "alloc_decode", lambda r: f"{r['bs']} | {r['page_size']} | "
                               f"{r['new_pages']}")):
        rows = res.get(key, [])
        if not rows:
            continue
        first = "| case | P | tokens " if key == "public_extend" else "| bs | P | new pages "
        lines += ["", f"## PagedTokenAllocator.{title}: the public call (µs per call in a loop)", "",
                  first + head, "|---" * (3 + 8) + "|"]
        for r in rows:
            p = r["paths"]
            cells = " | ".join(_loop(p.get(n)) if "skipped" not in p.get(n, {}) else "skipped" for n in names)
            syncs = " / ".join(_syncs(p.get(n)) for n in names)
            ratio = _ratio(r, "fast", "seed_wrapper", "loop_us")
            lines.append(f"| {label(r)} | {cells} | {ratio}{_round_ratios(r, 'fast', 'seed_wrapper')} | {syncs} | "
                         f"{'yes' if r.get('agree') else 'NO'} |")
    skipped = {e["skipped"] for r in res.get("public_extend", []) for e in r["paths"].values() if "skipped" in e}
    for s in sorted(skipped):
        lines.append(f"\nteaching and seed wrapper skipped where {s}.")
    if res.get("host_checks"):
        lines += ["", "## Host time of the length checks (µs, no device involved)", "",
                  "| bs | extend, CPU tensors | extend, lists | decode, CPU tensors | decode, lists |",
                  "|---|---|---|---|---|"]
        for r in res["host_checks"]:
            lines.append(f"| {r['bs']} | {r['extend_cpu_tensor_us']:.1f} | {r['extend_list_us']:.1f} | "
                         f"{r['decode_cpu_tensor_us']:.1f} | {r['decode_list_us']:.1f} |")
    pt = res.get("page_table_checks")
    if pt:
        lines += ["", f"Page-table write checks (`CacheManager.allocate_paged`, Triton writer): "
                  f"{pt['host_us']:.1f} µs of host time for {pt['entries']} entries."]
    cold = res.get("cold_process", {})
    if cold.get("first_calls"):
        lines += ["", "## First calls in a fresh process (ms; empty TRITON_CACHE_DIR)", "",
                  "Construction (compiles every kernel the fast path launches): " + "; ".join(
                      f"P={c['page_size']}: {c['ms']:.0f} ms (" + ", ".join(
                          f"{k} {v:.2f} s" for k, v in c["compile_seconds"].items()) + ")"
                      for c in cold["construct"]), ""]
        kinds = [k for k in cold["first_calls"][0] if k not in ("page_size", "bs")]
        lines += ["| P | bs | " + " | ".join(kinds) + " |", "|---" * (2 + len(kinds)) + "|"]
        for r in cold["first_calls"]:
            lines.append(f"| {r['page_size']} | {r['bs']} | " + " | ".join(f"{r[k]:.2f}" for k in kinds) + " |")
    elif cold.get("error"):
        lines += ["", f"First calls in a fresh process: {cold['error']}"]
    return lines


def write_outputs(res: dict, out_dir: str, log=print, *, plots: list[str] | None = None) -> list[str]:
    """``bench.json``, ``bench.md`` and the plots (``plots``: only these file names)."""
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
        if plots is not None and name not in plots:
            continue
        if name == "10_bench_serve.png" and not res.get("serve"):
            continue
        if name == "12_bench_memory.png" and not res.get("memory"):
            continue
        if name == "09_bench_attention.png":
            if not res.get("attention"):
                continue
        elif name.startswith("09_") and plot.__name__ != "plot_public_call" and not res.get("extend"):
            continue  # a run of the public calls only: the kernels' plots have no data
        if name == "09_public_call.png" and not res.get("public_extend"):
            continue
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
