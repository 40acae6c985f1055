"""The main job's picture: each cluster's training loss and the global model's validation loss, against tokens.

What the series are (``series`` builds them from the parsed Megatron logs, ``harness.launch.ClusterLog``):

- training loss: Megatron's ``lm loss`` at every ``--log-interval`` (the mean over the interval), one line per
  cluster. It is measured on that cluster's own replica θ and its own shard: the clusters' lines differ.
- validation loss: every Megatron evaluation, periodic (``--eval-interval``) and final, on the shared
  held-out split. The seam wraps Megatron's ``evaluate`` so that each one measures the global model φ, not
  the replica (``glue/seam.py``; ``tests/test_megatron_dilocox.py::test_evaluation_measures_the_global_model``).
  Mid-run φ is the model of the last round that landed (with the one-step delay, one round behind θ);
  the final evaluation comes after the last round's flush, when every cluster holds the same model, and is
  the SUMMARY's ``validation_loss``. Each evaluation reads the next ``--eval-iters`` batches, so two points
  differ in their batches as well as in the model (10 batches of 8 × 128 tokens: the main job's final φ reads
  4.78 and 4.75 on its last two). Every cluster evaluates the same φ on the same batches: their points coincide.
- tokens: iteration × global batch × sequence length of that cluster, i.e. what it has trained on so far.

The main job takes its SUMMARY figures from ``series``, and ``write`` draws exactly that dict and saves it
beside the PNG as ``loss.json``, so a test can hold the picture against the SUMMARY.
"""
from __future__ import annotations

import json
import os


def series(logs, seq_length: int) -> dict:
    """{"clusters": [{"cluster", "tokens_per_iteration", "train": {...}, "validation": {...}}]}: every list
    in the order of its iterations; validation carries ``final`` (Megatron's post-training evaluation)."""
    clusters = []
    for c, log in enumerate(logs):
        per_iteration = log.global_batch * seq_length
        its = sorted(log.losses)
        at = log.valid_at  # one (iteration, final?) per entry of valid_losses
        clusters.append({
            "cluster": c, "tokens_per_iteration": per_iteration,
            "train": {"iteration": its, "tokens": [i * per_iteration for i in its],
                      "loss": [log.losses[i] for i in its]},
            "validation": {"iteration": [i for i, _ in at],
                           "tokens": [None if i is None else i * per_iteration for i, _ in at],
                           "loss": list(log.valid_losses), "final": [final for _, final in at]},
        })
    return {"x": "tokens", "clusters": clusters}


def draw(data: dict, path: str, title: str) -> None:
    """Write ``data`` (from :func:`series`) as a PNG: one axis, loss against tokens."""
    from matplotlib.figure import Figure  # the object API: no pyplot, no global backend state (Agg via savefig)
    from matplotlib.ticker import EngFormatter

    fig = Figure(figsize=(10, 6), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    for entry in data["clusters"]:
        ax.plot(entry["train"]["tokens"], entry["train"]["loss"], color=f"C{entry['cluster']}", lw=1.6, marker=".",
                ms=4, label=f"cluster {entry['cluster']}: training loss (its replica θ, its shard)")
    for entry in data["clusters"]:
        c, color, valid = entry["cluster"], f"C{entry['cluster']}", entry["validation"]
        size = 9 - 3 * min(c, 2)  # nested markers: the clusters' points coincide, every cluster stays visible
        first = c == data["clusters"][0]["cluster"]  # one legend entry for every cluster's evaluations
        points = [(t, v, f) for t, v, f in zip(valid["tokens"], valid["loss"], valid["final"]) if t is not None]
        mid = [(t, v) for t, v, f in points if not f]
        if mid:
            ax.plot(*zip(*mid), ls="--", lw=0.8, color=color, marker="o", ms=size, mec="black", mew=0.6,
                    label="validation loss of the global model φ (each cluster evaluates it)" if first else None)
        for t, v, _ in (p for p in points if p[2]):
            ax.plot([t], [v], ls="none", color=color, marker="*", ms=size + 8, mec="black", mew=0.8,
                    label=f"final validation, after the last round: {v:.3f}" if first else None)
    ax.set_xlabel("tokens trained (per cluster)")
    ax.set_ylabel("lm loss (cross-entropy, nats per token)")
    ax.xaxis.set_major_formatter(EngFormatter())
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title(title, fontsize=10)
    fig.savefig(path, format="png")


def write(data: dict, out: str, title: str) -> str:
    """Draw ``data`` (from :func:`series`) as ``<out>/loss.png`` and save it, with the title, as
    ``<out>/loss.json``; return the PNG's path."""
    png = os.path.join(out, "loss.png")
    draw(data, png, title)
    with open(os.path.join(out, "loss.json"), "w") as f:
        json.dump(dict(data, title=title), f, indent=1)
    return png
