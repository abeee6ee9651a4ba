"""A sweep's plots, as PNG files in its directory: the metric against each
hyperparameter, and the learning curves: every config's as a band (so that
4,096 configs read as well as 8), the best ones drawn over it."""

from __future__ import annotations

import io

from strata.data.storage import join, write_bytes_atomic

COLORS = {"completed": "tab:blue", "stopped early": "tab:orange", "error": "tab:red"}


def write_plots(trials: list[dict], space: dict, cfg, sweep_dir: str, top: int = 5) -> list[str]:
    """Write params.png and curves.png; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    scored = [t for t in trials if t["best"] is not None]
    paths = []
    for name, fig in (("params.png", metric_vs_params(scored, space, cfg.metric)),
                      ("curves.png", curves(scored, cfg.report_every, top, cfg.metric, cfg.sign))):
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
        matplotlib.pyplot.close(fig)
        paths.append(join(sweep_dir, name))
        write_bytes_atomic(paths[-1], buf.getvalue())
    return paths


def metric_vs_params(trials: list[dict], space: dict, metric: str = "val_loss"):
    """One panel per hyperparameter: each trial's best metric against its value (points smaller and fainter
    as trials grow many, so a dense region reads as a density)."""
    import matplotlib.pyplot as plt

    size, alpha = (12, 0.7) if len(trials) <= 200 else (3, max(0.05, min(0.5, 60 / len(trials))))

    keys = sorted(space)
    cols = min(4, len(keys))
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.8 * rows), squeeze=False, sharey=True)
    for ax, key in zip(axes.flat, keys, strict=False):
        (dist, _), = space[key].items()
        for status, color in COLORS.items():
            pts = [(t["config"][key], t["best"]) for t in trials if t["status"] == status and key in t["config"]]
            if pts:
                ax.scatter(*zip(*pts, strict=True), s=size, alpha=alpha, color=color, label=status, linewidths=0)
        if dist == "loguniform":
            ax.set_xscale("log")
        ax.set_xlabel(key)
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel(f"best {metric}")
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    for handle in axes.flat[0].legend(fontsize=7).legend_handles:  # as drawn, faint points would not show
        handle.set_alpha(1)
    fig.suptitle(f"best {metric} by hyperparameter ({len(trials)} trials)")
    fig.tight_layout()
    return fig


def curves(trials: list[dict], report_every: int, top: int, metric: str = "val_loss", sign: float = 1.0):
    """The metric against steps: every config's as a band (the 10th-90th percentile at each report and the
    median, with how many configs reached it: ASHA stops most early), and the `top` best configs' curves."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(6.4, 4))
    length = max((len(t["curve"]) for t in trials), default=0)
    if len(trials) > top and length:
        steps = [report_every * (i + 1) for i in range(length)]
        at = [np.array([t["curve"][i] for t in trials if len(t["curve"]) > i], dtype=float) for i in range(length)]
        low, mid, high = (np.array([np.nanpercentile(v, q) for v in at]) for q in (10, 50, 90))
        ax.fill_between(steps, low, high, color="0.8", label=f"all {len(trials):,} configs, 10th-90th percentile")
        ax.plot(steps, mid, color="0.5", linestyle="--", label="median")
        for x, y, v in zip(steps, high, at, strict=True):
            ax.annotate(f"{len(v):,}", (x, y), fontsize=6, color="0.4", textcoords="offset points", xytext=(0, 3))
    for t in sorted(trials, key=lambda t: sign * t["best"])[:top]:
        steps = [report_every * (i + 1) for i in range(len(t["curve"]))]
        label = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(t["config"].items()))
        ax.plot(steps, t["curve"], marker="o", markersize=3, label=label[:60])
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))  # steps are whole
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    ax.set_title(f"learning curves: the {min(top, len(trials))} best of {len(trials):,} configs")
    fig.tight_layout()
    return fig
