"""PNG plots of a benchmarks/run.py result (matplotlib, headless).

  python -m benchmarks.plots [benchmarks/results/latest.json]

throughput-<model>.png   requests/s per workload and engine (one panel per workload)
serving-<model>.png      TTFT and TPOT distributions against concurrency, per server
profile-<model>.png      plait's step time by phase
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLORS = {
    "plait (radix cache on)": "#1f77b4",
    "plait (radix cache off)": "#aec7e8",
    "vllm (prefix cache on)": "#d62728",
    "vllm (prefix cache off)": "#ff9896",
    "transformers (static batch 16)": "#2ca02c",
    "transformers (one at a time)": "#98df8a",
    "plait server (radix cache on)": "#1f77b4",
    "plait server (radix cache off)": "#aec7e8",
    "vllm server (prefix cache on)": "#d62728",
    "vllm server (prefix cache off)": "#ff9896",
}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def throughput(model: str, off: dict, out: Path) -> Path | None:
    summary = off["summary"]
    if not summary:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(summary), figsize=(4.2 * len(summary), 4.2), squeeze=False)
    for ax, (w, rows) in zip(axes[0], summary.items()):
        names = [n for n, r in rows.items() if "req_s" in r]
        vals = [rows[n]["req_s"] for n in names]
        bars = ax.bar(range(len(names)), vals, color=[COLORS.get(n, "#7f7f7f") for n in names])
        for b, n in zip(bars, names):
            label = f"{rows[n]['req_s']:.1f}"
            if "json_valid" in rows[n]:
                label += f"\n{rows[n]['json_valid']:.0%} valid"
            ax.annotate(
                label,
                (b.get_x() + b.get_width() / 2, b.get_height()),
                ha="center",
                va="bottom",
                fontsize=7,
            )
        ax.set_xticks(
            range(len(names)),
            [n.replace(" (", "\n(") for n in names],
            rotation=60,
            ha="right",
            fontsize=7,
        )
        ax.set_title(w)
        ax.set_ylabel("requests / s")
        ax.margins(y=0.2)
    fig.suptitle(f"offline throughput, {model} (median)")
    fig.tight_layout()
    path = out / f"throughput-{model}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def serving(model: str, s: dict, out: Path) -> Path | None:
    servers = s.get("servers") or {}
    if not any(servers.values()):
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    names = list(servers)
    concs = sorted({int(c) for per_c in servers.values() for c in per_c})
    width = 0.8 / max(1, len(names))
    for metric, ax in zip(("ttft", "tpot"), axes[:2]):
        for i, name in enumerate(names):
            per_c = servers[name]
            cs = [c for c in concs if str(c) in per_c]
            data = [per_c[str(c)][f"{metric}_ms_all"] or [float("nan")] for c in cs]
            pos = [concs.index(c) + (i - (len(names) - 1) / 2) * width for c in cs]
            bp = ax.boxplot(
                data,
                positions=pos,
                widths=width * 0.9,
                patch_artist=True,
                showfliers=True,
                manage_ticks=False,
            )
            for patch in bp["boxes"]:
                patch.set_facecolor(COLORS.get(name, "#7f7f7f"))
            ax.plot([], [], color=COLORS.get(name, "#7f7f7f"), lw=6, label=name)
        ax.set_xticks(range(len(concs)), [str(c) for c in concs])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(
            ("time to first token" if metric == "ttft" else "time per output token") + " (ms)"
        )
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    ax = axes[2]
    for name in names:
        per_c = servers[name]
        cs = [c for c in concs if str(c) in per_c]
        ax.plot(
            cs, [per_c[str(c)]["out_tok_s"] for c in cs], "o-", label=name, color=COLORS.get(name)
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(concs, [str(c) for c in concs])
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens / s")
    ax.legend(fontsize=8)
    fig.suptitle(f"serving (benchmarks/serving.py client, streamed chat completions), {model}")
    fig.tight_layout()
    path = out / f"serving-{model}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def profile(model: str, prof: dict, out: Path) -> Path | None:
    cases = {k: v for k, v in prof.get("cases", {}).items() if "share" in v}
    if not cases:
        return None
    plt = _plt()
    phases: list[str] = []
    for v in cases.values():
        phases += [p for p in v["share"] if p not in phases]
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.6 * len(cases)))
    left = [0.0] * len(cases)
    cmap = plt.get_cmap("tab10")
    for j, p in enumerate(phases):
        vals = [v["share"].get(p, 0.0) * 100 for v in cases.values()]
        ax.barh(range(len(cases)), vals, left=left, label=p, color=cmap(j % 10))
        left = [a + b for a, b in zip(left, vals)]
    ax.set_yticks(
        range(len(cases)),
        [f"{k}\n{v['ms_per_step']:.1f} ms/forward" for k, v in cases.items()],
        fontsize=8,
    )
    ax.set_xlabel("% of wall time")
    ax.set_xlim(0, 100)
    ax.legend(
        fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.25 - 0.05 * len(cases))
    )
    ax.set_title(f"plait step time by phase, {model}")
    fig.tight_layout()
    path = out / f"profile-{model}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def make_plots(result: dict, out: Path) -> list[str]:
    """Write every plot the result has data for; their file names (relative to `out`)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [throughput(m, off, out) for m, off in result.get("offline", {}).items()]
    paths += [serving(m, s, out) for m, s in result.get("serving", {}).items()]
    profiles = result.get("profile", {})
    if "cases" in profiles:  # one profile (older results)
        profiles = {"plait": profiles}
    paths += [profile(m, prof, out) for m, prof in profiles.items()]
    return [p.name for p in paths if p is not None]


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    path = Path(argv[0] if argv else Path(__file__).parent / "results" / "latest.json")
    for name in make_plots(json.loads(path.read_text()), path.parent):
        print(path.parent / name)


if __name__ == "__main__":
    main()
