"""The memory-policy benchmark in ``bench.md`` and its picture (``12_bench_memory.png``), drawn
from the saved result (``res["memory"]``), so they read the same on a laptop as on the GPU."""
from __future__ import annotations

#: policy -> colour (the chapter's pictures use the same)
POLICY_COLOURS = {"reserve": "#6a51a3", "recompute": "#e6550d", "retract": "#3182bd", "swap": "#31a354"}


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
              + ". One timed run per row after a warm-up; tokens/s = new tokens / wall time of the call. "
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
            lines.append(head + f" failed: {r['error']} | | | | | | | |")
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
    import numpy as np

    m = res["memory"]
    workloads = list(m["workloads"])
    pools = list(m["pools"])
    policies = list(POLICY_COLOURS)
    fig, axes = plt.subplots(2, len(workloads), figsize=(8.4, 4.6), squeeze=False, sharey="row")
    for col, name in enumerate(workloads):
        for row, (key, label) in enumerate((("tokens_per_s", "new tokens / s"),
                                            ("mean_running", "requests running at once"))):
            ax = axes[row][col]
            x = np.arange(len(pools))
            for k, policy in enumerate(policies):
                vals = []
                for pool in pools:
                    hit = [r for r in m["rows"] if (r["workload"], r["pool"], r["policy"]) == (name, pool, policy)
                           and "error" not in r]
                    vals.append(hit[0][key] if hit else 0.0)
                ax.bar(x + (k - 1.5) * 0.2, vals, 0.2, color=POLICY_COLOURS[policy], label=policy)
            ax.set_xticks(x, pools, fontsize=8)
            ax.tick_params(labelsize=7)
            if col == 0:
                ax.set_ylabel(label, fontsize=8)
            if row == 0:
                ax.set_title(name.replace("_", " "), fontsize=9)
    axes[0][0].legend(fontsize=7, ncol=2)
    where = "SMOKE RUN (not timings)" if m.get("smoke") else m.get("meta", {}).get("device", "")
    fig.suptitle(f"four memory policies, pools from ample to tight; {where}", fontsize=9)
    fig.tight_layout()
    return fig
