"""The serving benchmark in ``bench.md`` and its picture (``10_bench_serve.png``), drawn from
the saved result (``res["serve"]``), so they read the same on a laptop as on the GPU."""
from __future__ import annotations

from ..course.viz.legibility import MAX_WIDTH_IN

#: path -> what the report calls it
SERVE_LABELS = {"kvlab": "kvlab, overlap scheduling", "kvlab_no_overlap": "kvlab, no overlap",
                "kvlab_subset": "kvlab, overlap scheduling", "kvlab_no_overlap_subset": "kvlab, no overlap",
                "generate": "transformers generate (one padded batch)",
                "generate_static_compiled": "transformers generate, static cache + torch.compile",
                "generate_batch": "transformers generate_batch (its manager)"}
COLORS = {"kvlab": "#2e7d32", "kvlab_no_overlap": "#a5d6a7", "kvlab_subset": "#2e7d32",
          "kvlab_no_overlap_subset": "#a5d6a7", "generate": "#5b7fbf", "generate_batch": "#8e6c8a",
          "generate_static_compiled": "#2f4f8f"}


def _f(x, fmt="{:.0f}") -> str:
    return "–" if x is None else fmt.format(x)


def _verdict(t: dict) -> str:
    return "n/a (smoke)" if t["passed"] is None else ("PASS" if t["passed"] else "FAIL")


def serve_section(s: dict) -> list[str]:
    """Markdown lines for ``res["serve"]``."""
    lines = ["", "## Serving a real model (chapter 10): `python -m kvlab.bench --serve`", ""]
    if "offline" not in s:
        return lines + ["(recorded by an older version of this benchmark: run it again)"]
    m, off = s["model"], s["offline"]
    w = off["workload"]
    if s.get("meta"):
        mm = s["meta"]
        lines += [f"{mm['device']}; torch {mm['torch']}, triton {mm['triton']}, transformers "
                  f"{mm['transformers']}; {mm['date']}; {mm['seconds']} s. Produced by: `{mm['command']}`", ""]
    if s.get("smoke"):
        lines += ["**Smoke run: these numbers are not timings and make no claim.**", ""]
    model = ("a tiny random Qwen3 (smoke run)" if m.get("tiny") else
             f"a random-weight model with Qwen3-0.6B's configuration ({m['num_hidden_layers']} layers, "
             f"hidden {m['hidden_size']}, {m['num_attention_heads']} query heads of {m['head_dim']} on "
             f"{m['num_key_value_heads']} K/V heads, vocabulary {m['vocab_size']})")
    lines += [f"Model: {model}, {m['dtype']}, greedy, no end of text.", "",
              "| target | rule | measured | result |", "|---|---|---|---|"]
    lines += [f"| {t['name']} | {t['rule']} | {_f(t['measured'], '{:.2f}')} | **{_verdict(t)}** |"
              for t in s["targets"]]
    n, cap = w["baseline_requests"], w["baseline_answer_cap"]
    lines += ["", "### Offline", "",
              f"nano-vllm's `bench.py` workload (mini-sglang's offline benchmark adapts it): {w['requests']} "
              f"requests, seed {w['seed']}, prompts of {w['shortest']}-{w['longest']} random tokens "
              f"({w['prompt_tokens']} in all), answers of {w['shortest']}-{w['longest']} tokens "
              f"({w['output_tokens']} in all). Tokens/s = requested output tokens / wall time of the "
              "whole call, as both projects compute it. kvlab: a cold prefix cache, one run each. "
              f"**transformers' two paths ran only the first {n} requests, answers cut to at most {cap} "
              f"tokens ({w['baseline_tokens']} output tokens)**: their loops would take minutes for the whole "
              f"workload. kvlab ran those same {n} requests too, and the generate and generate_batch targets compare "
              "kvlab with each on them. `generate` takes one `max_new_tokens` per call: its batch runs to the longest "
              "answer, and only each request's own tokens count.", "",
              "| path | requests | tokens | seconds | tokens/s | steps | most running | floor, s (x floor) |",
              "|---|---|---|---|---|---|---|---|"]
    for name, e in off["paths"].items():
        if "error" in e:
            lines.append(f"| {SERVE_LABELS.get(name, name)} | failed: {e['error']} | | | | | | |")
            continue
        st = e.get("stats", {})
        floor = (f"{e['floor_s']:.2f} ({e['ratio_to_floor']:.2f})" if e.get("floor_s") else "–")
        steps = st.get("steps", "–") if st else (f"{e['generated'] // e['requests']} (one batch)"
                                                  if e.get("generated") else "–")
        lines.append(f"| {SERVE_LABELS.get(name, name)} | {e['requests']} | {e['tokens']} | {e['seconds']:.2f} | "
                     f"{e['tokens_per_s']:.0f} | {steps} | {st.get('most_running', '–')} | {floor} |")
    lines += _floor_lines(off) + _static_cache_lines(off)
    lines += _online_lines(s["online"]) + _busy_lines(s["busy"])
    if s.get("skipped"):
        lines += ["", "Not run (the time budget of one GPU call, or the interpreter): " + "; ".join(s["skipped"]) + "."]
    return lines


def _floor_lines(off: dict) -> list[str]:
    f = off.get("floor")
    if not f:
        return []
    peak = f"{f['peak_flops'] / 1e12:.0f} TFLOP/s (dense bfloat16)" if f.get("peak_flops") else "unknown (bytes only)"
    flops = f"{f['flops_s']:.2f} s" if f.get("flops_s") is not None else "–"
    lines = ["", f"The floor of a run (`kvlab.bench.serve_floor`): for each of its {f['steps']} steps the larger of "
             "its bytes (every weight, the output projection's too; the K/V every decoding request reads, its "
             f"new token's included; the logits) over the measured bandwidth ({f['gb_per_s']:.0f} GB/s) and its "
             f"FLOPs (2 x parameters x tokens, plus the prompts' attention) over the GPU's peak, {peak}; summed: "
             f"**{f['seconds']:.2f} s** ({f['bytes'] / 1e12:.2f} TB: {f['bytes_s']:.2f} s of bytes; "
             f"{f['flops'] / 1e12:.0f} TFLOP: {flops} of arithmetic)."]
    return lines


def _static_cache_lines(off: dict) -> list[str]:
    """Which way transformers' static cache + torch.compile ran (and why an earlier one did not)."""
    lines = []
    static = off["paths"].get("generate_static_compiled", {})
    if static.get("compile_s"):
        lines += ["", f"transformers' static cache + torch.compile: {static['path']}, as its optimisation guide "
                  "(`docs/source/en/llm_optims.md`) recommends; its first call, which compiles, took "
                  f"{static['compile_s']:.1f} s and is not counted; the row is its second call."]
        for error in static.get("earlier_ways_failed", []):
            lines += [f"Tried first and failed here: {error}"]
    return lines


def _online_lines(on: dict) -> list[str]:
    w = on["workload"]
    lines = ["", "### Online", "",
             f"{w['requests']} requests arriving as a Poisson process (seed {w['seed']}) at each rate; prompts "
             f"of {w['shortest']}-{w['longest']} random tokens, answers of {w['answer_shortest']}-"
             f"{w['answer_longest']}. Latencies in ms, p50 / p99; requests/s = requests / (last token - "
             "first arrival). Where requests/s stops following the rate, the server is saturated.", "",
             "| path | rate, req/s | requests/s | TTFT p50 / p99 | ITL p50 / p99 | end-to-end p50 / p99 |",
             "|---|---|---|---|---|---|"]
    for name, rates in on["paths"].items():
        for rate, r in rates.items():
            if "error" in r:
                lines.append(f"| {SERVE_LABELS.get(name, name)} | {rate} | failed: {r['error']} | | | |")
                continue
            pair = lambda d: "–" if not d else f"{_f(d['p50'])} / {_f(d['p99'])}"  # noqa: E731
            lines.append(f"| {SERVE_LABELS.get(name, name)} | {rate} | {r['requests_per_s']:.1f} | "
                         f"{pair(r['ttft_ms'])} | {pair(r['itl_ms'])} | {pair(r['e2e_ms'])} |")
    return lines


def _busy_lines(busy: dict) -> list[str]:
    w = busy["workload"]
    lines = ["", "### GPU busy during decode steps", "",
             f"Requests of {w['prompt']} prompt tokens and {w['answer']} new tokens, all decoding together. "
             "CUDA events around each step's device work; step k's busy share = its device time / "
             "(end of step k - end of step k-1); medians over the decode steps with every request running.", "",
             "| running | overlap | busy share | step, ms | device, ms | steps |", "|---|---|---|---|---|---|"]
    for name, r in busy["paths"].items():
        mode, running = name.rsplit("_", 1)
        lines.append(f"| {running} | {'on' if mode == 'overlap' else 'off'} | {_f(r.get('busy'), '{:.3f}')} | "
                     f"{_f(r.get('step_ms'), '{:.2f}')} | {_f(r.get('device_ms'), '{:.2f}')} | {r.get('steps', 0)} |")
    return lines


def plot_serve(res: dict):
    """Offline tokens/s; the GPU's busy share of a decode step; online TTFT p50 and requests/s
    by arrival rate."""
    import matplotlib.pyplot as plt

    s = res["serve"]
    fig, axes = plt.subplots(2, 2, figsize=(MAX_WIDTH_IN, 5.6), gridspec_kw={"width_ratios": [3, 2]})
    _offline_bars(axes[0, 0], s)
    _busy_bars(axes[0, 1], s)
    online = s.get("online", {}).get("paths", {})
    for name, rates in online.items():
        ok = sorted((float(r), v) for r, v in rates.items() if "error" not in v)
        ttft = [(r, v["ttft_ms"]["p50"]) for r, v in ok if v.get("ttft_ms") and v["ttft_ms"]["p50"] is not None]
        style = dict(color=COLORS.get(name, "gray"), label=SERVE_LABELS.get(name, name), ms=3)
        if ttft:
            axes[1, 0].plot(*zip(*ttft), "o-", **style)
        if ok:
            axes[1, 1].plot([r for r, _ in ok], [v["requests_per_s"] for _, v in ok], "o-", **style)
    rates = sorted({float(r) for v in online.values() for r in v}) or [1.0]
    same = axes[1, 1].plot(rates, rates, ":", color="black", lw=0.8, label="= the arrival rate")
    for ax, ylabel, title in ((axes[1, 0], "TTFT p50, ms", "online: time to first token"),
                              (axes[1, 1], "served, requests/s", "online: where it saturates")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("arrival rate, requests/s", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_title(title, fontsize=8)
    # the online paths' names once, under both panels; the right one names its dotted line
    handles, labels = axes[1, 0].get_legend_handles_labels()
    axes[1, 1].legend(handles=same, fontsize=7, loc="upper left")
    for ax in axes.flat:
        ax.tick_params(which="both", labelsize=7)
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=len(handles), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.05 if handles else 0, 1, 1))
    return fig


def _offline_bars(ax, s: dict) -> None:
    off = s.get("offline", {}).get("paths", {})
    names = [n for n, e in off.items() if e.get("tokens_per_s")]
    vals = [off[n]["tokens_per_s"] for n in names]
    ax.barh(range(len(names)), vals, color=[COLORS.get(n, "gray") for n in names])
    for i, v in enumerate(vals):
        ax.text(v, i, f" {v:.0f}", va="center", fontsize=7)
    ceiling = [(i, off[n]["tokens"] / off[n]["floor_s"]) for i, n in enumerate(names) if off[n].get("floor_s")]
    for i, v in ceiling:                 # the floor's tokens/s: what the steps it took would allow
        ax.plot([v, v], [i - 0.4, i + 0.4], color="black", lw=1.2, label="its floor" if i == ceiling[0][0] else None)
        vals.append(v)
    if ceiling:
        ax.legend(fontsize=7, loc="lower right")
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels([f"{SERVE_LABELS.get(n, n)}, {off[n]['requests']} req." for n in names], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, max(vals, default=1) * 1.3)
    ax.set_xlabel("output tokens / s", fontsize=8)
    where = "smoke run: not timings" if s.get("smoke") else s.get("meta", {}).get("device", "")
    ax.set_title(f"offline ({where})", fontsize=8)


def _busy_bars(ax, s: dict) -> None:
    busy = s.get("busy", {}).get("paths", {})
    running = sorted({int(k.rsplit("_", 1)[1]) for k in busy})
    for i, n in enumerate(running):
        for j, mode in enumerate(("no_overlap", "overlap")):
            v = busy.get(f"{mode}_{n}", {}).get("busy")
            if v is None:
                continue
            x = i + (j - 0.5) * 0.38
            ax.bar(x, v, width=0.36, color=COLORS["kvlab" if j else "kvlab_no_overlap"],
                   label=("overlap" if j else "no overlap") if i == 0 else None)
            ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
    ax.axhline(0.9, color="black", lw=0.8, ls=":")
    ax.set_xticks(range(len(running)))
    ax.set_xticklabels([f"{n} running" for n in running], fontsize=7)
    ax.set_ylim(0, 1.3)
    ax.set_yticks([0, 0.25, 0.5, 0.75, 0.9, 1.0])
    ax.set_ylabel("GPU busy share of a decode step", fontsize=8)
    ax.legend(fontsize=7, loc="upper center", ncol=2)
    ax.set_title("decode steps (dotted: the 0.9 target)", fontsize=8)
