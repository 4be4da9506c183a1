"""The decode-attention benchmark in ``bench.md`` and its picture (``09_bench_attention.png``),
drawn from the saved result (``res["attention"]``), so they read the same on a laptop."""
from __future__ import annotations

#: path -> what the report calls it
KERNEL_LABELS = {"teaching": "chapter 08 kernel (one program per query head)",
                 "fast": "chapter 09 kernel (grouped heads, split, merge)",
                 "sdpa": "transformers SDPA (contiguous K/V)"}
STEP_LABELS = {"fast_compiled": "fast kernels + torch.compile", "fast": "fast kernels",
               "teaching": "chapter 08 kernel"}
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
    return lines


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
    ax2.axhline(3.0, color="black", lw=0.8, ls="--")
    top = max([e["ratio_to_floor"] for r in steps for e in r["paths"].values()], default=3.0)
    ax2.set_ylim(0, max(top, 3.0) * 1.55)
    ax2.set_xticks(range(len(steps)))
    ax2.set_xticklabels([str(r["batch"]) for r in steps], fontsize=7)
    ax2.set_xlabel("running requests", fontsize=8)
    ax2.set_ylabel("step replay / floor", fontsize=8)
    ax2.set_title("whole decode step (dashed: 3x)", fontsize=8)
    ax2.legend(fontsize=7, loc="upper left")
    ax2.tick_params(labelsize=7)
    fig.tight_layout()
    return fig
