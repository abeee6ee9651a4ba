"""A sweep's plots, as PNG files in its directory: the metric against each
hyperparameter, and the learning curves of the best trials."""

from __future__ import annotations

import io

from strata.storage import join, write_bytes_atomic

COLORS = {"completed": "tab:blue", "stopped early": "tab:orange", "error": "tab:red"}


def write_plots(trials: list[dict], space: dict, cfg, sweep_dir: str, top: int = 5) -> list[str]:
    """Write params.png and curves.png; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    scored = [t for t in trials if t["best"] is not None]
    paths = []
    for name, fig in (("params.png", metric_vs_params(scored, space, cfg.metric)),
                      ("curves.png", top_curves(scored, cfg.report_every, top, cfg.metric, cfg.sign))):
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
        matplotlib.pyplot.close(fig)
        paths.append(join(sweep_dir, name))
        write_bytes_atomic(paths[-1], buf.getvalue())
    return paths


def metric_vs_params(trials: list[dict], space: dict, metric: str = "val_loss"):
    """One panel per hyperparameter: each trial's best metric against its value."""
    import matplotlib.pyplot as plt

    keys = sorted(space)
    cols = min(4, len(keys))
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.8 * rows), squeeze=False, sharey=True)
    for ax, key in zip(axes.flat, keys, strict=False):
        (dist, _), = space[key].items()
        for status, color in COLORS.items():
            pts = [(t["config"][key], t["best"]) for t in trials if t["status"] == status and key in t["config"]]
            if pts:
                ax.scatter(*zip(*pts, strict=True), s=12, alpha=0.7, color=color, label=status)
        if dist == "loguniform":
            ax.set_xscale("log")
        ax.set_xlabel(key)
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel(f"best {metric}")
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"best {metric} by hyperparameter ({len(trials)} trials)")
    fig.tight_layout()
    return fig


def top_curves(trials: list[dict], report_every: int, top: int, metric: str = "val_loss", sign: float = 1.0):
    """The metric against steps for the `top` best trials."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for t in sorted(trials, key=lambda t: sign * t["best"])[:top]:
        steps = [report_every * (i + 1) for i in range(len(t["curve"]))]
        label = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(t["config"].items()))
        ax.plot(steps, t["curve"], marker="o", markersize=3, label=label[:60])
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    ax.set_title(f"learning curves of the {min(top, len(trials))} best trials")
    fig.tight_layout()
    return fig
