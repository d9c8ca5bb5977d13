"""PNG plots of the GPU benchmark: decode and prefill tokens/s by budget and system, co-run timelines."""

from __future__ import annotations

from pathlib import Path

COLORS = {"slipstream": "#1f77b4", "llama.cpp-default": "#ff7f0e", "llama.cpp-tuned": "#d62728",
          "accelerate": "#2ca02c", "bound": "#7f7f7f"}


def _lines(result: dict, series, ylabel: str, title: str, path: Path) -> None:
    """Per model: one line per system over the budgets (the bound dashed), for each (key, label, style,
    transform) of `series` (a transform turns a row's value into what is plotted, e.g. tokens/s into
    seconds to the first token); log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    if not models:
        return
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 5.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        mr = [r for r in rows if r["model"] == model]
        budgets = sorted({r["budget_bytes"] for r in mr if r.get("budget_bytes")})
        systems = [s for s in COLORS if any(r["system"] == s for r in mr)]
        for key, label, style, f in series:
            for s in systems:
                pts = []
                for b in budgets:
                    r = next((r for r in mr if r["system"] == s and r.get("budget_bytes") == b), None)
                    if r is not None and r.get(key) and (s == "bound" or r.get("fits") is not False):
                        pts.append((b / 2 ** 30, f(r[key])))
                if not pts:
                    continue
                xs, ys = zip(*pts)
                ax.plot(xs, ys, style if s != "bound" else ":", color=COLORS[s], marker="o", ms=4,
                        label=f"{s}{label}", alpha=0.7 if s == "bound" else 1)
                for x, y in pts:
                    ax.annotate(f"{y:.3g}", (x, y), fontsize=6, textcoords="offset points", xytext=(3, 3))
        ax.set_xticks([b / 2 ** 30 for b in budgets], [f"{b / 2 ** 30:g} GiB" for b in budgets])
        ax.set_xlabel("VRAM budget (whole process for Slipstream)")
        ax.set_title(f"{model}: {title}")
        ax.set_ylabel(ylabel)
        ax.set_yscale("log")
        ax.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.16))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _same(v):
    return v


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
    """Tokens/s (decode, prefill of 4096 tokens) and time to the first token (prompts of 512 and 4096
    tokens: tokens / prefill rate, which is how both sides measure it) against the budget, one line per
    system; the co-run timelines. Rows that did not fit their budget are left out."""
    paths = [out / "results_decode.png", out / "results_prefill.png", out / "results_ttft.png",
             out / "corun_timeline.png"]
    _lines(result, [("decode_tps", "", "-", _same)], "tokens/s", "decode tokens/s (1 sequence)", paths[0])
    _lines(result, [("prefill4096_tps", "", "-", _same)], "tokens/s", "prefill tokens/s (4096-token prompt)",
           paths[1])
    _lines(result, [("prefill4096_tps", " (4096)", "-", lambda v: 4096 / v),
                    ("prefill512_tps", " (512)", "--", lambda v: 512 / v)],
           "seconds", "time to first token", paths[2])
    _corun(result, paths[3])
    return [p for p in paths if p.exists()]
