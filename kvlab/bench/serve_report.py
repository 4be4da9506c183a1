"""The serving benchmark in ``bench.md`` and its picture (``10_bench_serve.png``), drawn from
the saved result (``res["serve"]``), so they read the same on a laptop as on the GPU."""
from __future__ import annotations

from ..viz.legibility import MAX_WIDTH_IN

#: path -> what the report calls it
SERVE_LABELS = {"generate": "transformers `generate` (one left-padded batch)",
                "generate_batch": "transformers `generate_batch` (continuous batching, paged cache)",
                "kvlab": "kvlab `PagedGenerator` (chunked prefill, CUDA-graph decode)",
                "kvlab_no_chunks": "kvlab, whole prompts (no chunking)",
                "kvlab_no_graphs": "kvlab, decode steps without graphs"}
COLORS = {"generate": "#5b7fbf", "generate_batch": "#8e6c8a", "kvlab": "#2e7d32",
          "kvlab_no_chunks": "#66bb6a", "kvlab_no_graphs": "#a5d6a7"}


def _f(x, fmt="{:.0f}") -> str:
    return "–" if x is None else fmt.format(x)


def serve_section(s: dict) -> list[str]:
    """Markdown lines for ``res["serve"]``."""
    w = s["workload"]
    m = w["model"]
    model = ("a tiny random Llama (smoke run)" if m.get("tiny") else
             f"a random-weight Llama: {m['num_hidden_layers']} layers, hidden {m['hidden_size']}, "
             f"{m['num_attention_heads']} query heads on {m['num_key_value_heads']} K/V heads, "
             f"vocabulary {m['vocab_size']}")
    lines = ["", "## Serving a real model (chapter 10): `python -m kvlab.bench --serve`", ""]
    if s.get("meta"):
        mm = s["meta"]
        lines += [f"{mm['device']}; torch {mm['torch']}, triton {mm['triton']}, transformers "
                  f"{mm['transformers']}; {mm['date']}; {mm['seconds']} s. Produced by: `{mm['command']}`", ""]
    if s.get("smoke"):
        lines += ["**Smoke run: these numbers are not timings and make no claim.**", ""]
    lines += [f"{model}, {m['dtype']}; {w['requests']} prompts of {w['shortest']}-{w['longest']} tokens "
              f"({w['prompt_tokens']} in all), every other one behind one shared {w['shared_len']}-token "
              f"prefix; {w['new_tokens']} new tokens each, greedy, no end of text. Each path ran once to "
              f"warm up, then {s['rounds']} times in a rotating order; tokens/s = new tokens / wall time "
              "of the whole call (median of the runs; the range in brackets). kvlab's prefix cache is "
              "emptied before every run (cold), so each run computes the shared prefix once.", "",
              "| target | rule | measured | result |", "|---|---|---|---|"]
    for t in s["targets"]:
        verdict = "n/a (smoke)" if t["passed"] is None else ("PASS" if t["passed"] else "FAIL")
        lines.append(f"| {t['name']} | {t['rule']} | {_f(t['measured'], '{:.2f}')} | **{verdict}** |")
    lines += ["", "| path | tokens/s | runs, s | start-up, s | steps | most running | prompt tokens "
              "computed / cached | chunks | graph steps |", "|---|---|---|---|---|---|---|---|---|"]
    for name, e in s["paths"].items():
        if "error" in e and not e.get("seconds"):
            lines.append(f"| {SERVE_LABELS.get(name, name)} | failed: {e['error']} | | | | | | | |")
            continue
        lo, hi = e.get("tokens_per_s_range", [None, None])
        st = e.get("stats", {})
        lines.append(
            f"| {SERVE_LABELS.get(name, name)} | {_f(e.get('tokens_per_s'))} ({_f(lo)}–{_f(hi)}) | "
            + ", ".join(f"{x:.2f}" for x in e["seconds"]) + f" | {_f(e.get('startup_s'), '{:.1f}')} | "
            f"{st.get('steps', '–')} | {st.get('most_running', '–')} | "
            + (f"{st['prefill_computed']} / {st['prefill_cached']}" if st else "–")
            + f" | {st.get('chunks', '–')} | {st.get('graph_steps', '–')} |")
    d = s.get("decode_step_ms", {})
    lines += ["", f"Decode step at {d.get('batch', '?')} running requests (ms, medians over the last timed "
              "run): kvlab, a whole step of the loop (schedule, map, pad, replay, read the tokens back, "
              f"complete): {_f(d.get('kvlab'), '{:.2f}')}, of which the forward pass on the GPU "
              f"{_f(d.get('kvlab_forward_gpu'), '{:.2f}')}; kvlab without graphs: "
              f"{_f(d.get('kvlab_no_graphs'), '{:.2f}')} (forward on the GPU "
              f"{_f(d.get('kvlab_no_graphs_forward_gpu'), '{:.2f}')}); transformers `generate` at batch "
              f"{d.get('batch', '?')} ((time for 65 new tokens - time for 1) / 64): {_f(d.get('generate'), '{:.2f}')}."]
    return lines


def plot_serve(res: dict):
    """Tokens/s of each path (top); the generator's steps over its last timed run (bottom).

    One column, :data:`kvlab.viz.legibility.MAX_WIDTH_IN` wide: the panels are stacked and the
    step panel's legend sits above its plot, where it covers no bar and no line."""
    import matplotlib.pyplot as plt

    s = res["serve"]
    names = [n for n, e in s["paths"].items() if e.get("tokens_per_s")]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(MAX_WIDTH_IN, 7.4), gridspec_kw={"height_ratios": [4, 5]})
    vals = [s["paths"][n]["tokens_per_s"] for n in names]
    ax1.barh(range(len(names)), vals, height=0.45, color=[COLORS.get(n, "gray") for n in names])
    for i, (n, v) in enumerate(zip(names, vals)):  # each path named above its bar: the bars keep the width
        ax1.text(v, i, f" {v:.0f}", va="center", fontsize=9)
        ax1.text(0, i - 0.27, SERVE_LABELS.get(n, n).replace("`", ""), va="bottom", fontsize=9)
    ax1.set_yticks([])
    ax1.set_ylim(len(names) - 0.5, -0.85)
    ax1.set_xlabel("new tokens / s (median of the timed runs)", fontsize=9)
    ax1.set_xlim(0, max(vals) * 1.2 if vals else 1)
    where = "SMOKE RUN (not timings)" if s.get("smoke") else s.get("meta", {}).get("device", "")
    ax1.set_title(f"{s['workload']['requests']} requests, {s['workload']['new_tokens']} new tokens each; {where}",
                  fontsize=10)
    steps = s["paths"].get("kvlab", {}).get("steps", [])
    xs = range(len(steps))
    for kind, color, label in (("prefill", "#fd8d3c", "step with prompt tokens (eager)"),
                               ("decode", "#2e7d32", "decode-only step (CUDA graph)")):
        pts = [(i, st["ms"]) for i, st in zip(xs, steps) if st["kind"] == kind]
        ax2.bar([p[0] for p in pts], [p[1] for p in pts], color=color, label=label, width=0.9)
    ax2.set_xlabel("step of kvlab's last timed run", fontsize=9)
    ax2.set_ylabel("wall time of the step, ms", fontsize=9)
    twin = ax2.twinx()
    twin.plot(list(xs), [st["running"] for st in steps], color="black", lw=1.2, label="requests in the step")
    twin.set_ylabel("requests in the step", fontsize=9)
    twin.set_ylim(0, max([st["running"] for st in steps], default=1) * 1.1)
    h1, l1 = ax2.get_legend_handles_labels()
    h2, l2 = twin.get_legend_handles_labels()
    ax2.legend(h1 + h2, l1 + l2, fontsize=8, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=3,
               frameon=False, borderaxespad=0.2, handlelength=1.5, columnspacing=1.2)
    ax2.set_title("kvlab PagedGenerator, step by step", fontsize=10, pad=22)
    fig.tight_layout()
    return fig
