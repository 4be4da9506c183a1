"""The KV-hierarchy benchmark in ``bench.md`` and its picture (``13_bench_hierarchy.png``), drawn
from the saved result (``res["hierarchy"]``), so they read the same on a laptop as on the GPU."""
from __future__ import annotations


def _f(x, fmt="{:.0f}") -> str:
    return "–" if x is None else fmt.format(x)


def hierarchy_section(h: dict) -> list[str]:
    """Markdown lines for ``res["hierarchy"]``."""
    model = h["model"]
    what = ("chapter 10's tiny random Llama (smoke run)" if model.get("tiny") else
            f"a random-weight Llama of a 0.5B model's shape ({model['num_hidden_layers']} layers, "
            f"{model['num_key_value_heads']} K/V heads)")
    lines = ["", "## A KV hierarchy (chapter 13): `python -m kvlab.bench --hierarchy`", ""]
    if h.get("meta"):
        m = h["meta"]
        lines += [f"{m['device']}; torch {m['torch']}, triton {m['triton']}, transformers "
                  f"{m['transformers']}; {m['date']}; {m.get('seconds', '?')} s. Produced by: `{m['command']}`", ""]
    if h.get("smoke"):
        lines += ["**Smoke run: these numbers are not timings and make no claim.**", ""]
    pinned = h["pinned"]
    lines += [f"{what}, {model['dtype']}; page size {h['page_size']}. {h['turns']} turns of "
              f"{h['plan']['conversations']} conversations (histories up to {h['plan']['history_cap']} tokens), "
              f"working set {h['working_set_tokens']} tokens = {h['working_set_ratio']:.1f} x the device pool "
              f"of {h['device_pages']} pages. Pinned bandwidth measured in the run: host to device "
              f"{_f(pinned.get('h2d_gbps'), '{:.1f}')} GB/s, back {_f(pinned.get('d2h_gbps'), '{:.1f}')} GB/s.", "",
              "| claim | rule | measured | result |", "|---|---|---|---|"]
    for c in h["claims"]:
        verdict = "n/a (smoke)" if h.get("smoke") else ("n/a" if c["passed"] is None else
                                                        ("PASS" if c["passed"] else "FAIL"))
        lines.append(f"| {c['name']} | {c['rule']} | {c['measured']} | **{verdict}** |")
    lines += ["", "| configuration | hit (device / host / disk) | computed | MiB to device / to host | "
              "GB/s to device / to host | TTFT ms p50 / p99 | TPOT ms p50 / p99 | tokens/s |", "|---|---|---|---|---|---|---|---|"]
    ms = lambda x: _f(None if x is None else x * 1e3, "{:.1f}")  # noqa: E731
    for r in h["rows"]:
        head = f"| {r['config']} |"
        if "error" in r:
            lines.append(head + f" {r['error']} | | | | | | |")
            continue
        hit = (f"{r['hit']:.1%} ({r['device_hit']:.1%} / {r['host_hit']:.1%} / {r['disk_hit']:.1%})"
               if "hit" in r else f"disk {r['disk_hit']:.1%}")
        lines.append(head + f" {hit} | {r['computed']} | {r['h2d_bytes'] / 2**20:.1f} / {r['d2h_bytes'] / 2**20:.1f} | "
                     f"{_f(r.get('load_gbps'), '{:.1f}')} / {_f(r.get('save_gbps'), '{:.1f}')} | {ms(r.get('ttft_p50'))} / {ms(r.get('ttft_p99'))} | "
                     f"{ms(r.get('tpot_p50'))} / {ms(r.get('tpot_p99'))} | {_f(r.get('tokens_per_s'))} |")
    d = h.get("decode") or {}
    if d.get("ratio") is not None:
        lines += ["", f"Decode steps with write-through copies in flight: {d['write_through_ms']:.2f} ms, without: "
                  f"{d['without_ms']:.2f} ms ({d['steps']} steps compared, batch size by batch size)."]
    return lines


def plot_hierarchy(res: dict):
    """Hit rate by tier and prompt tokens computed, per configuration."""
    import matplotlib.pyplot as plt

    h = res.get("hierarchy")
    if not h:
        fig, ax = plt.subplots(figsize=(8.4, 1.2))
        ax.text(0.5, 0.5, "no GPU run of `python -m kvlab.bench --hierarchy` in bench.json yet",
                ha="center", va="center", fontsize=9)
        ax.set_axis_off()
        return fig
    rows = [r for r in h["rows"] if "error" not in r and "hit" in r]
    names = [r["config"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(8.4, 3.2))
    bottom = [0.0] * len(rows)
    for key, colour, label in (("device_hit", "#6a51a3", "device"), ("host_hit", "#31a354", "host"),
                               ("disk_hit", "#e6550d", "disk")):
        vals = [100 * r[key] for r in rows]
        a.barh(names, vals, left=bottom, color=colour, label=label)
        bottom = [x + v for x, v in zip(bottom, vals)]
    a.set_xlabel("prompt tokens found cached (%)", fontsize=8)
    a.legend(fontsize=7, frameon=False)
    b.barh(names, [r["computed"] for r in rows], color="#9e9ac8")
    b.set_xlabel("prompt tokens computed", fontsize=8)
    b.set_yticklabels([])
    for ax in (a, b):
        ax.tick_params(labelsize=7)
        ax.invert_yaxis()
    where = "SMOKE RUN (not timings)" if h.get("smoke") else h.get("meta", {}).get("device", "")
    fig.suptitle(f"multi-turn chats, working set {h['working_set_ratio']:.1f} x the device pool; {where}", fontsize=9)
    fig.tight_layout()
    return fig
