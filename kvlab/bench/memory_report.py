"""The memory-policy benchmark in ``bench.md`` and its picture (``12_bench_memory.png``), drawn
from the saved result (``res["memory"]``), so they read the same on a laptop as on the GPU."""
from __future__ import annotations


def _f(x, fmt="{:.0f}") -> str:
    return "–" if x is None else fmt.format(x)


def memory_section(m: dict) -> list[str]:
    """Markdown lines for ``res["memory"]``."""
    model = m["model"]
    what = ("chapter 10's tiny random Llama (smoke run)" if model.get("tiny") else
            f"a random-weight Llama of a 0.5B model's shape ({model['num_hidden_layers']} layers, hidden "
            f"{model['hidden_size']}, {model['num_attention_heads']} query heads on "
            f"{model['num_key_value_heads']} K/V heads)")
    lines = ["", "## When KV memory runs out (chapter 12): `python -m kvlab.bench --memory`", ""]
    if m.get("meta"):
        mm = m["meta"]
        lines += [f"{mm['device']}; torch {mm['torch']}, triton {mm['triton']}, transformers "
                  f"{mm['transformers']}; {mm['date']}; {mm['seconds']} s. Produced by: `{mm['command']}`", ""]
    if m.get("smoke"):
        lines += ["**Smoke run: these numbers are not timings and make no claim.**", ""]
    lines += [f"{what}, {model['dtype']}; page size {m['page_size']}. The simulator's seeded workloads, "
              "served offline (every request arrives at once); each answer ends where the workload's does "
              "(the scheduler knows only `max_new_tokens`). Pools per workload, as a share of every whole "
              "answer at once: " + ", ".join(f"{k} {v:.0%}" for k, v in m["pools"].items())
              + "".join(f"; {w} only in {' and '.join(ps)} memory (with ample memory it stops nobody)"
                        for w, ps in m.get("workload_pools", {}).items() if w in m["workloads"])
              + ". One timed run per row after a warm-up (a row started past the time budget says it was "
              "skipped); tokens/s = new tokens / wall time of the call. "
              "TTFT and TPOT in ms (p50 / p99 over the requests); unused = pages promised but not mapped, "
              "mean per step.", "", "| claim | rule | measured | result |", "|---|---|---|---|"]
    for c in m["claims"]:
        verdict = "n/a (smoke)" if m.get("smoke") else ("n/a" if c["passed"] is None else
                                                        ("PASS" if c["passed"] else "FAIL"))
        lines.append(f"| {c['name']} | {c['rule']} | {c['measured']} | **{verdict}** |")
    lines += ["", "| workload | pool | pages | policy | tokens/s | running (mean / most) | unused pages | "
              "stops | recomputed | swapped MiB | TTFT ms p50 / p99 | TPOT ms p50 / p99 |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in m["rows"]:
        head = f"| {r['workload']} | {r['pool']} | {r['pages']} | {r['policy']} |"
        if "error" in r:
            lines.append(head + f" {r['error']} | | | | | | | |")
            continue
        ms = lambda x: _f(None if x is None else x * 1e3, "{:.1f}")  # noqa: E731
        lines.append(head + f" {_f(r['tokens_per_s'])} | {r['mean_running']:.1f} / {r['most_running']} | "
                     f"{r['unused_pages']:.1f} | {r['stops']} | {r['recomputed_tokens']} | "
                     f"{r['swapped_out_bytes'] / 2**20:.1f} | {ms(r['ttft_p50'])} / {ms(r['ttft_p99'])} | "
                     f"{ms(r['tpot_p50'])} / {ms(r['tpot_p99'])} |")
    return lines


def plot_memory(res: dict):
    """Tokens/s and requests running at once, per policy, workload and pool."""
    import matplotlib.pyplot as plt

    from ..course.viz.policies import policy_bars

    m = res.get("memory")
    if not m:  # figures/bench.json without a --memory run: say so rather than draw nothing
        fig, ax = plt.subplots(figsize=(8.4, 1.2))
        ax.text(0.5, 0.5, "no GPU run of `python -m kvlab.bench --memory` in bench.json yet",
                ha="center", va="center", fontsize=9)
        ax.set_axis_off()
        return fig
    rows = [r for r in m["rows"] if "error" not in r]
    fig, axes = plt.subplots(2, len(m["workloads"]), figsize=(8.4, 4.6), squeeze=False, sharey="row")
    policy_bars(rows, "tokens_per_s", "new tokens / s", axes=axes[0], pools=list(m["pools"]))
    policy_bars(rows, "mean_running", "running at once", axes=axes[1], pools=list(m["pools"]))
    for ax in axes[1]:
        ax.set_title("")
    axes[1][-1].get_legend().remove()
    where = "SMOKE RUN (not timings)" if m.get("smoke") else m.get("meta", {}).get("device", "")
    fig.suptitle(f"four memory policies, pools from ample to tight; {where}", fontsize=9)
    fig.tight_layout()
    return fig
