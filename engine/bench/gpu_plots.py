"""PNG plots of the GPU benchmark: decode and prefill tokens/s by budget and system, co-run timelines."""

from __future__ import annotations

from pathlib import Path

COLORS = {"slipstream": "#1f77b4", "llama.cpp-default": "#ff7f0e", "llama.cpp-tuned": "#d62728",
          "accelerate": "#2ca02c", "bound": "#7f7f7f"}


def _bars(result: dict, key: str, title: str, path: Path, log: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    if not models:
        return
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        mr = [r for r in rows if r["model"] == model]
        budgets = list(dict.fromkeys(r["budget"] for r in sorted(mr, key=lambda r: r.get("budget_bytes") or 0)))
        systems = [s for s in COLORS if any(r["system"] == s for r in mr)]
        width = 0.8 / max(1, len(systems))
        for i, s in enumerate(systems):
            vals = []
            for b in budgets:
                r = next((r for r in mr if r["system"] == s and r["budget"] == b), None)
                vals.append(r.get(key) or 0 if r else 0)
            xs = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(budgets))]
            hatch = "//" if s == "bound" else None
            ax.bar(xs, vals, width, label=s, color=COLORS[s], hatch=hatch, alpha=0.6 if s == "bound" else 1)
            for x, v in zip(xs, vals):
                if v:
                    ax.text(x, v, f"{v:.3g}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(budgets)), budgets)
        ax.set_title(f"{model}: {title}")
        ax.set_ylabel("tokens/s")
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _corun(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [c for c in result.get("corun", []) if c.get("timeline")]
    if not runs:
        return
    fig, axes = plt.subplots(2, len(runs), figsize=(7 * len(runs), 7), squeeze=False, sharex="col")
    for col, c in enumerate(runs):
        tl = c["timeline"]
        ax = axes[0][col]
        g = tl["game"]
        ax.plot([x[0] for x in g], [x[1] for x in g], color="#9467bd", label="game frames/s")
        ax.set_ylabel("game frames/s")
        ax2 = ax.twinx()
        m = tl["model_tps"]
        ax2.plot([x[0] for x in m], [x[1] for x in m], color=COLORS.get(c["system"], "#1f77b4"), marker=".",
                 lw=0.8, label="model tokens/s")
        ax2.set_ylabel("model tokens/s")
        for t, kind in tl.get("oom_events", []):
            ax.axvline(t, color="red", lw=0.8, ls=":")
        title = c["system"] + (f" (-ngl {c['ngl']})" if "ngl" in c else " (auto budget)")
        ax.set_title(f"{title}: game OOM attempts {c.get('game_ooms')}, over cap {c.get('card_over_cap_s')} s")
        ax.legend(loc="lower left", fontsize=8)
        ax2.legend(loc="lower right", fontsize=8)
        ax = axes[1][col]
        v = tl["vram"]
        ts = [x[0] for x in v]
        gib = 2**30
        ax.stackplot(ts, [x[2] / gib for x in v], [x[3] / gib for x in v], labels=["game", "model"],
                     colors=["#9467bd", COLORS.get(c["system"], "#1f77b4")], alpha=0.7)
        ax.axhline(c["cap_bytes"] / gib, color="black", ls="--", lw=1, label="card cap")
        be = tl.get("budget_events", [])
        if be:
            ax.step([b[0] for b in be], [b[1] / gib for b in be], where="post", color="black", lw=0.8,
                    label="Slipstream budget")
        ax.set_xlabel("seconds")
        ax.set_ylabel("VRAM GiB (NVML)")
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_all(result: dict, out: Path) -> list[Path]:
    paths = [out / "results_decode.png", out / "results_prefill.png", out / "corun_timeline.png"]
    _bars(result, "decode_tps", "decode tokens/s (1 sequence)", paths[0], log=True)
    _bars(result, "prefill4096_tps", "prefill tokens/s (4096-token prompt)", paths[1], log=True)
    _corun(result, paths[2])
    return [p for p in paths if p.exists()]
