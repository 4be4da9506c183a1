"""The decode-attention benchmark in ``bench.md`` and its picture (``09_bench_attention.png``),
drawn from the saved result (``res["attention"]``), so they read the same on a laptop."""
from __future__ import annotations

#: path -> what the report calls it
KERNEL_LABELS = {"teaching": "chapter 08 kernel (one program per query head)",
                 "fast": "chapter 09 kernel (grouped heads, split, merge)",
                 "sdpa": "transformers SDPA (contiguous K/V)"}
STEP_LABELS = {"fast_compiled": "fast kernels + torch.compile", "fast": "fast kernels",
               "teaching": "chapter 08 kernel"}
#: the decode step's targets, by running requests (kvlab.bench.decode.STEP_LIMITS)
STEP_LIMITS = {64: 2.0, 256: 1.5}
COLORS = {"teaching": "#d9534f", "fast": "#2e7d32", "sdpa": "#5b7fbf", "fast_compiled": "#1b5e20"}


def _f(x, fmt="{:.1f}") -> str:
    return "–" if x is None else fmt.format(x)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


def attention_section(a: dict) -> list[str]:
    """Markdown lines for ``res["attention"]``."""
    s, bw = a["shape"], a["bandwidth"]
    lines = ["", "## Decode attention at the memory floor (chapter 09): `python -m kvlab.bench --attention`", ""]
    if a.get("meta"):
        m = a["meta"]
        lines += [f"{m['device']}; torch {m['torch']}, triton {m['triton']}, transformers "
                  f"{m.get('transformers', '?')}; {m['date']}; {a.get('seconds', '?')} s. Produced by: "
                  f"`{m['command']}`", ""]
    if a.get("smoke"):
        lines += ["**Smoke run: these numbers are not timings and make no claim.**", ""]
    lines += [f"Bandwidth: a device-to-device copy of {_mb(bw['bytes_copied'])} took {bw['us']:.0f} µs: "
              f"**{bw['gb_per_s']:.0f} GB/s** (read + write). The floor of a call is the bytes it must "
              "move divided by that bandwidth.", "",
              f"Attention: {s['heads']} query heads on {s['kv_heads']} K/V heads of {s['head_dim']}, "
              f"{s['dtype']} pools, pages of {s['page_size']} tokens (shuffled), every request of the batch "
              "the same context; each path captured in a CUDA graph, time = `triton.testing.do_bench` median "
              "(L2 flushed before each call). Floor bytes: K/V once + page-table entries + q + out.", "",
              "| target | rule | measured | result |", "|---|---|---|---|"]
    for t in a["targets"]:
        verdict = "n/a (smoke)" if t["passed"] is None else ("PASS" if t["passed"] else "FAIL")
        lines.append(f"| {t['name']} | {t['rule']} | {t['measured']} | **{verdict}** |")
    lines += ["", "| batch | context | floor bytes | floor, µs | chapter 08 kernel, µs (x floor) | chapter 09 "
              "kernel, µs (x floor) | splits | SDPA, µs (x floor) | 08 / 09 |", "|---|---|---|---|---|---|---|---|---|"]
    for r in a["kernel"]:
        if r.get("skipped"):
            lines.append(f"| {r['batch']} | {r['ctx']} | {_mb(r['bytes']['floor'])} | {r['floor_us']:.1f} | "
                         f"skipped: {r['skipped']} | | | | |")
            continue
        p = r["paths"]

        def cell(name):
            e = p.get(name, {})
            return f"{_f(e.get('us'))} ({_f(e.get('ratio_to_floor'), '{:.2f}')})"

        speedup = p["teaching"]["us"] / p["fast"]["us"]
        lines.append(f"| {r['batch']} | {r['ctx']} | {_mb(r['bytes']['floor'])} | {r['floor_us']:.1f} | "
                     f"{cell('teaching')} | {cell('fast')} | {r.get('num_splits', '–')} | {cell('sdpa')} | "
                     f"{speedup:.1f} |")
    lines += ["", "By design the chapter 08 kernel reads each K/V head's rows once per query head of its group "
              f"({s['heads'] // s['kv_heads']} times here; the L2 may serve some of those reads), the chapter 09 "
              "kernel once. Outputs of the two kernels agree within "
              f"{max((r.get('agree_max_abs', 0.0) for r in a['kernel']), default=0.0):.1e} (max abs difference)."]
    st = a.get("step", {})
    if st.get("rows"):
        lines += ["", f"Decode step of the serving model (`kvlab.bench.serve`), {st['context_range'][0]}-"
                  f"{st['context_range'][1]} tokens of context per request: the padded step's CUDA-graph replay "
                  "(µs per step, back-to-back replays) and `DecodeGraphs.run` (the same with the host's "
                  "padding and copies). Floor bytes: weights (not the embedding table) + K/V + new K/V + logits.",
                  "", "| running | floor bytes | floor, µs | " + " | ".join(
                      f"{STEP_LABELS.get(n, n)}: replay (x floor) / run" for n in st["rows"][0]["paths"]) + " |",
                  "|---" * (3 + len(st["rows"][0]["paths"])) + "|"]
        for r in st["rows"]:
            cells = " | ".join(f"{e['replay_us']:.0f} ({e['ratio_to_floor']:.2f}) / {e['run_us']:.0f}"
                               for e in r["paths"].values())
            lines.append(f"| {r['batch']} | {_mb(r['bytes']['floor'])} | {r['floor_us']:.0f} | {cells} |")
        starts = ", ".join(f"{STEP_LABELS.get(n, n)} {v:.1f} s" for n, v in st.get("startup_s", {}).items())
        lines += ["", f"Start-up (graphs captured at {st['batches']}): {starts}. torch.compile graphs built at "
                  f"start-up: {st.get('graphs_built_at_startup', '–')}; while serving afterwards: "
                  f"{st.get('graphs_built_while_serving', '–')}."]
        lines += _profile_lines(st["rows"])
    lines += _public_lines(a.get("public", [])) + _startup_lines(a.get("startup"))
    return lines


def _profile_lines(rows: list[dict]) -> list[str]:
    rows = [r for r in rows if "profile" in r]
    if not rows:
        return []
    lines = ["", "Where the step's time goes (`kvlab.bench.step_profile`: `torch.profiler` over 5 replays, kernels by "
             "kind; floor = the kind's bytes / the copy bandwidth):", "",
             "| running | kind | kernels | µs per step | floor, µs |", "|---|---|---|---|---|"]
    for r in rows:
        for k in r["profile"]["by_kind"]:
            lines.append(f"| {r['batch']} | {k['kind']} | {k['kernels']} | {k['us']:.0f} | {k['floor_us']:.0f} |")
    return lines


def _public_lines(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    names = list(rows[0]["paths"])
    lines = ["", "The public call as a caller meets it (`kvlab.bench.decode_call`): one call then "
             "`torch.cuda.synchronize()`, host wall time per call (median of interleaved rounds), host time "
             "without the wait, syncs per call (torch's sync debug mode). `fast`: "
             "`fast_paged_decode_attention` with its checks; `sdpa`: transformers' SDPA on contiguous K/V.", "",
             "| batch x context | " + " | ".join(f"{n}: synced µs (x SDPA) / host µs / syncs" for n in names) + " |",
             "|---" * (1 + len(names)) + "|"]
    for r in rows:
        cells = " | ".join(f"{e['wall_us']:.1f} ({_f(e.get('vs_sdpa'), '{:.2f}')}) / {e['host_us']:.1f} / "
                           f"{_f(e.get('syncs'), '{}')}" for e in r["paths"].values())
        lines.append(f"| {r['batch']} x {r['ctx']} | {cells} |")
    return lines


def _startup_lines(boot: dict | None) -> list[str]:
    if not boot:
        return []
    runs = {k: v for k, v in boot.items() if isinstance(v, dict)}
    cells = "; ".join(f"{k}: " + (f"{v['seconds']:.1f} s ({v.get('dynamo_graphs', '–')} graphs, cache "
                                  f"`{v.get('cache') or '–'}`)" if "seconds" in v else f"failed: {v.get('error', '')[:200]}")
                      for k, v in runs.items())
    return ["", f"Start-up of the serving generator (`kvlab.bench.startup`, {boot.get('command', '')}): {cells}."]


def plot_attention(res: dict):
    """Time / floor of each kernel per shape (left); the decode step's replay per variant (right)."""
    import matplotlib.pyplot as plt

    a = res["attention"]
    rows = [r for r in a["kernel"] if not r.get("skipped")]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8.4, 3.6), gridspec_kw={"width_ratios": [3, 1.3]})
    width = 0.27
    for i, name in enumerate(("teaching", "fast", "sdpa")):
        xs = [j + (i - 1) * width for j in range(len(rows))]
        ax1.bar(xs, [r["paths"][name]["ratio_to_floor"] for r in rows], width, color=COLORS[name],
                label=KERNEL_LABELS[name])
    ax1.axhline(1.0, color="black", lw=0.8)
    ax1.axhline(2.0, color="black", lw=0.8, ls="--")
    ax1.set_yscale("log")
    ax1.set_xticks(range(len(rows)))
    ax1.set_xticklabels([f"{r['batch']}\n{r['ctx']}" for r in rows], fontsize=7)
    ax1.set_xlabel("batch / context (tokens)", fontsize=8)
    ax1.set_ylabel("time / HBM floor (log)", fontsize=8)
    where = "SMOKE RUN (not timings)" if a.get("smoke") else a.get("meta", {}).get("device", "")
    ax1.set_title(f"decode attention vs the floor (dashed: 2x); {where}", fontsize=8)
    ax1.legend(fontsize=7, loc="upper right")
    ax1.tick_params(labelsize=7)
    steps = a.get("step", {}).get("rows", [])
    names = list(steps[0]["paths"]) if steps else []
    for i, name in enumerate(names):
        xs = [j + (i - (len(names) - 1) / 2) * 0.25 for j in range(len(steps))]
        ax2.bar(xs, [r["paths"][name]["ratio_to_floor"] for r in steps], 0.25,
                color=COLORS.get(name, "gray"), label=STEP_LABELS.get(name, name))
    for j, r in enumerate(steps):      # each size's target (2.0x at 64, 1.5x at 256)
        limit = STEP_LIMITS.get(r["batch"], max(STEP_LIMITS.values()))
        ax2.plot([j - 0.45, j + 0.45], [limit] * 2, color="black", lw=0.8, ls="--")
    top = max([e["ratio_to_floor"] for r in steps for e in r["paths"].values()], default=3.0)
    ax2.set_ylim(0, max(top, 2.0) * 1.55)
    ax2.set_xticks(range(len(steps)))
    ax2.set_xticklabels([str(r["batch"]) for r in steps], fontsize=7)
    ax2.set_xlabel("running requests", fontsize=8)
    ax2.set_ylabel("step replay / floor", fontsize=8)
    ax2.set_title("whole decode step (dashed: target)", fontsize=8)
    ax2.legend(fontsize=7, loc="upper left")
    ax2.tick_params(labelsize=7)
    fig.tight_layout()
    return fig


#: kinds of the step's kernels, as the picture names them (kvlab.bench.step_profile.ORDER)
KIND_COLORS = {"attention": "#2e7d32", "K/V store": "#d9534f", "matrix products": "#5b7fbf",
               "norms, rotary, activation": "#e0a030", "greedy choice": "#8e6c8a",
               "copies and gathers": "#888888", "other": "#bbbbbb"}


def plot_step_profile(runs: list[dict], batches=(64, 256)):
    """The decode step at each of ``batches`` running requests (a panel each): kernel time by
    kind against each kind's floor (its bytes over the measured bandwidth), a bar per recorded
    run (the last one solid): where the time goes and how far each kind of work is from what its
    bytes allow."""
    import matplotlib.pyplot as plt

    panels = []
    for batch in batches:
        rows = [(run, next((r for r in run["rows"] if r["batch"] == batch), None)) for run in runs]
        panels.append((batch, [(run, r) for run, r in rows if r is not None]))
    panels = [(b, rows) for b, rows in panels if rows]
    kinds = [k for k in KIND_COLORS if any(x["kind"] == k for _, rows in panels for _, r in rows
                                           for x in r["by_kind"])]
    n_runs = max(len(rows) for _, rows in panels)
    fig, axes = plt.subplots(len(panels), 1, squeeze=False,
                             figsize=(8.4, len(panels) * (0.9 + 0.22 * len(kinds) * n_runs)))
    height = 0.8 / n_runs
    for ax, (batch, rows) in zip(axes[:, 0], panels):
        for j, (run, r) in enumerate(rows):
            by = {x["kind"]: x for x in r["by_kind"]}
            for i, kind in enumerate(kinds):
                x = by.get(kind, dict(us=0.0, floor_us=0.0, kernels=0))
                y = i + (j - (len(rows) - 1) / 2) * height
                ax.barh(y, x["us"], height * 0.9, color=KIND_COLORS[kind], alpha=1.0 if j == len(rows) - 1 else 0.4)
                ax.plot([x["floor_us"]] * 2, [y - height * 0.45, y + height * 0.45], color="black", lw=1.5)
                ax.text(x["us"], y, f" {x['us']:.0f} µs, {x['kernels']} kernels ({run['label'].split(':')[0]})",
                        va="center", fontsize=7)
        ax.set_yticks(range(len(kinds)))
        ax.set_yticklabels(kinds, fontsize=7)
        ax.invert_yaxis()
        top = max((x["us"] for _, r in rows for x in r["by_kind"]), default=1.0)
        ax.set_xlim(0, top * 1.6)
        totals = "; ".join(f"{run['label'].split(':')[0]} {r['replay_us']:.0f} µs ({r['replay_us'] / r['floor_us']:.2f}x)"
                           for run, r in rows)
        ax.set_title(f"{batch} running requests, step floor {rows[-1][1]['floor_us']:.0f} µs: {totals}", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[-1, 0].set_xlabel("µs per decode step; black line: the kind's floor (its bytes / bandwidth)", fontsize=8)
    fig.tight_layout()
    return fig
