"""Plots (PNG) and JSON of what the library computed, for a person to look at."""
import json
from dataclasses import asdict
from typing import Dict, Iterable, List, Optional


def dataclass_json(obj, path=None) -> str:
    """A dataclass as indented JSON; also written to `path` when given."""
    text = json.dumps(asdict(obj), indent=2)
    if path is not None:
        with open(path, "w") as f:
            f.write(text)
    return text


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path):
    """Write a figure as a PNG and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)


def moving_average(values: List[float], window: int) -> List[float]:
    """Trailing mean of the last `window` values at every position (fewer at the start)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_layer_scores(scores: List[float], path, ylabel: str, title: str, highlight: Iterable[int] = (),
                      label: str = "selected"):
    """Bar chart of one score per layer; the `highlight`ed layers (e.g. the selected ones) in
    orange, named in a legend as `label`."""
    plt = _pyplot()
    chosen = sorted(set(highlight))
    fig, ax = plt.subplots(figsize=(max(6, 0.3 * len(scores) + 2), 3.5))
    bars = ax.bar(range(len(scores)), scores,
                  color=["tab:orange" if i in chosen else "tab:blue" for i in range(len(scores))])
    if chosen:
        other = next((bars[i] for i in range(len(scores)) if i not in chosen), None)
        handles = [bars[chosen[0]]] + ([other] if other is not None else [])
        names = [f"{label}: layer{'s' if len(chosen) > 1 else ''} {', '.join(map(str, chosen))}"]
        ax.legend(handles, names + (["other layers"] if other is not None else []), fontsize=8)
    ax.set_xlabel("layer")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    _save(fig, path)


def plot_unit_rates(units, values: List[float], path, title: str = "per-unit learning-rate multiplier",
                    label: Optional[str] = None):
    """Heatmap of one value per unit: rows = the copies, named by the layer they copy in the
    numbering of the model before expansion (as the run's log and report name them) and by their
    own index in the expanded model; columns = tensors."""
    plt = _pyplot()
    layers = sorted({(u.layer, u.source_layer) for u in units})
    copies = [layer for layer, _ in layers]
    columns: Dict[str, int] = {}
    for u in units:
        columns.setdefault(u.name.split(f".{u.layer}.", 1)[1].removesuffix(".weight"), len(columns))
    grid = [[float("nan")] * len(columns) for _ in layers]
    row_of = {layer: i for i, (layer, _) in enumerate(layers)}
    for u, v in zip(units, values):
        grid[row_of[u.layer]][columns[u.name.split(f".{u.layer}.", 1)[1].removesuffix(".weight")]] = v
    fig, ax = plt.subplots(figsize=(1.0 * len(columns) + 2.5, 0.5 * len(layers) + 2))
    im = ax.imshow(grid, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(columns)), list(columns), rotation=45, ha="right")
    ax.set_yticks(range(len(layers)), [f"copy of layer {s - sum(c < s for c in copies)} (layer {l} expanded)"
                                       for l, s in layers])
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if v == v:
                color = "white" if v < (max(values) + min(values)) / 2 else "black"
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", color=color, fontsize=8)
    fig.colorbar(im, ax=ax, label=label or "multiplier of lr")
    ax.set_title(title)
    _save(fig, path)


def plot_loss_curves(history: Dict, base: Dict, path, title: str = "loss"):
    """Training loss per step (raw, and its moving average: a single batch's loss varies more
    than the trend) and held-out general/domain loss at each evaluation (base as step 0)."""
    plt = _pyplot()
    fig, (train_ax, eval_ax) = plt.subplots(1, 2, figsize=(11, 3.8))
    steps = [h["step"] for h in history["train"]]
    losses = [h["loss"] for h in history["train"]]
    window = max(2, min(50, len(losses) // 6))
    train_ax.plot(steps, losses, lw=0.8, color="tab:blue", alpha=0.4, label="per step (one batch)")
    if len(losses) > window:  # from the first full window on: shorter means at the start are noise
        train_ax.plot(steps[window - 1:], moving_average(losses, window)[window - 1:], lw=2, color="tab:blue",
                      label=f"moving average ({window} steps)")
    train_ax.legend(fontsize=8)
    train_ax.set_xlabel("step")
    train_ax.set_ylabel("training loss (domain)")
    steps = [0] + [e["step"] for e in history["eval"]]
    for key, label in (("general_loss", "general (held out)"), ("domain_loss", "domain (held out)")):
        eval_ax.plot(steps, [base[key]] + [e[key] for e in history["eval"]], marker="o", label=label)
    eval_ax.set_xlabel("step")
    eval_ax.set_ylabel("held-out loss")
    eval_ax.legend()
    fig.suptitle(title)
    _save(fig, path)


def plot_merge_front(front: List[Dict], chosen: float, path, title: str = "merging back"):
    """The merge-back front: general Δloss (forgetting) against domain Δloss (gain) from the base at each
    α (labelled), the chosen α marked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4.2))
    ax.plot([p["general_delta"] for p in front], [p["domain_delta"] for p in front], marker="o", color="tab:blue")
    for point in front:
        ax.annotate(f"α={point['alpha']:g}", (point["general_delta"], point["domain_delta"]), fontsize=7,
                    textcoords="offset points", xytext=(4, 3))
    pick = next(p for p in front if p["alpha"] == chosen)
    ax.plot([pick["general_delta"]], [pick["domain_delta"]], marker="*", markersize=14, color="tab:red",
            label=f"chosen α = {chosen:g}")
    ax.axvline(0, color="grey", lw=0.6)
    ax.set_xlabel("general held-out Δloss (forgetting)")
    ax.set_ylabel("domain held-out Δloss (gain: lower is better)")
    ax.legend(fontsize=8)
    ax.set_title(title)
    _save(fig, path)


def plot_diagnosis(path, p_task: List[float], task_particle: int, js: List[float], delta_js: List[Optional[float]],
                   importance: Optional[List[float]], title: str, boundary: Optional[int] = None):
    """LayerTracer's views of one model on a shared layer axis: task probability P̄_t(i) (task
    particle marked), sensitivity JS_i and ΔJS(i), and ADEPT's layer importance when given; the
    freeze_deep boundary as a dashed line."""
    plt = _pyplot()
    rows = 3 if importance is not None else 2
    n = len(p_task)
    fig, axes = plt.subplots(rows, 1, figsize=(max(7, 0.3 * n + 3), 2.6 * rows), sharex=True)
    axes[0].plot(range(n), p_task, marker="o", ms=3)
    axes[0].axvline(task_particle, color="tab:red", lw=1, label=f"task particle (layer {task_particle})")
    axes[0].set_yscale("log")  # P_t spans orders of magnitude across the layers
    axes[0].set_ylabel("P_t(layer) (log)")
    axes[0].legend(fontsize=8)
    axes[1].plot(range(n), js, marker="o", ms=3, color="tab:purple", label="JS(P, Q(layer))")
    axes[1].set_ylabel("JS (nats)")
    twin = axes[1].twinx()
    twin.bar(range(1, n), [d for d in delta_js[1:]], color="tab:gray", alpha=0.4, label="ΔJS (relative)")
    twin.set_ylabel("ΔJS")
    axes[1].legend(loc="upper left", fontsize=8)
    twin.legend(loc="upper right", fontsize=8)
    if importance is not None:
        axes[2].bar(range(n), importance, color="tab:blue")
        axes[2].set_ylabel("Δ loss bypassed")
    for ax in axes:
        if boundary is not None:
            ax.axvline(boundary - 0.5, color="black", ls="--", lw=1)
    axes[-1].set_xlabel("decoder layer" + (" (dashed: freeze_deep boundary)" if boundary is not None else ""))
    axes[0].set_title(title)
    _save(fig, path)


def plot_matrix(matrix: List[List[float]], row_labels: List[str], column_labels: List[str], path, title: str):
    """Heatmap of a score matrix with every value written in its cell; the colour is scaled per
    column (each task's own range), since accuracies and −losses do not share a scale."""
    plt = _pyplot()
    columns = list(zip(*matrix))
    shade = [[(v - min(c)) / (max(c) - min(c)) if max(c) > min(c) else 0.5 for v, c in zip(row, columns)]
             for row in matrix]
    fig, ax = plt.subplots(figsize=(1.8 * len(column_labels) + 2.5, 0.55 * len(row_labels) + 1.8))
    ax.imshow(shade, cmap="viridis", aspect="auto", vmin=0, vmax=1)
    ax.set_xticks(range(len(column_labels)), column_labels)
    ax.set_yticks(range(len(row_labels)), row_labels)
    for i, row in enumerate(matrix):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.3f}", ha="center", va="center", color="white" if shade[i][j] < 0.5 else "black")
    ax.set_xlabel("task scored (colour: scaled within the column; yellow = best)")
    ax.set_ylabel("model after")
    ax.set_title(title)
    _save(fig, path)


def plot_series(labels: List[str], values: List[float], path, ylabel: str, title: str):
    """One line over named points (e.g. general loss after each task)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(labels) + 2), 3.5))
    ax.plot(range(len(values)), values, marker="o")
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    _save(fig, path)
