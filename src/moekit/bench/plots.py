"""Plots of the MoE-block and expert-MLP tables (TF/s of forward + backward per shape and implementation).

Reads the markdown tables that the benchmarks write, so a figure can be redrawn from committed results:
    python -m moekit.bench.plots bench/results/<run>/moe.md bench/results/<run>/experts.md out.png
"""

from __future__ import annotations

import sys


def _rows(path: str) -> list[list[str]]:
    with open(path) as fh:
        return [[c.strip() for c in line.strip().strip("|").split("|")] for line in fh if line.startswith("| ")]


def _step_tflops(path: str) -> dict:
    """{(shape, impl): TF/s of forward + backward} from a moe.md or experts.md table (the MoE table's
    plain-SwiGLU rows; rows without timings, such as a SonicMoE timeout, are left out)."""
    rows = _rows(path)
    head = rows[0]
    col = {name: i for i, name in enumerate(head)}
    out = {}
    for r in rows[1:]:
        if len(r) != len(head) or r[0].startswith("---") or r[col.get("config", 0)] == "gpt-oss":
            continue
        try:
            total = float(r[col["fwd+bwd ms"]])
            if "TF/s" in col:  # moe table: the rate of the step
                out[r[0], r[col["impl"]]] = float(r[col["TF/s"]])
            else:  # experts table: 3x the forward FLOPs over the step
                out[r[0], r[1]] = 3 * float(r[col["fwd TF/s"]]) * float(r[col["fwd ms"]]) / total
        except (ValueError, KeyError):
            continue
    return out


_COLORS = {"moekit": "tab:blue", "sonicmoe": "tab:purple", "torchtitan": "tab:orange", "dense": "tab:gray"}


def plot(tables: dict[str, str], path: str) -> None:
    """One panel per table: bars of effective TF/s (expert FLOPs of forward + backward over time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tables), figsize=(6 * len(tables), 4), squeeze=False)
    for ax, (title, table) in zip(axes[0], tables.items(), strict=True):
        data = _step_tflops(table)
        shapes = sorted({s for s, _ in data})
        impls = [i for i in ("moekit", "sonicmoe", "torchtitan", "dense") if any((s, i) in data for s in shapes)]
        width = 0.8 / len(impls)
        for k, impl in enumerate(impls):
            xs = [j + (k - (len(impls) - 1) / 2) * width for j in range(len(shapes))]
            ax.bar(xs, [data.get((s, impl), 0) for s in shapes], width, label=impl, color=_COLORS[impl])
        ax.set_xticks(range(len(shapes)), shapes, fontsize=7, rotation=30, ha="right")
        ax.set_ylabel("TF/s (fwd + bwd)")
        ax.set_title(title)
        ax.set_ylim(0, 1.2 * max(data.values(), default=1))  # headroom for the legend above the bars
        ax.legend(fontsize=8, loc="upper center", ncol=len(impls))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    moe_md, experts_md, out_png = sys.argv[1:4]
    plot({"MoE block": moe_md, "expert MLP": experts_md}, out_png)
