"""Attention plots for the passphrase experiment (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path


def plot_attention(weights, path: Path, title: str, secret_span: tuple[int, int]) -> None:
    """weights[step][layer][head][position] -> one panel per (layer, head): the attention of the
    first captured answer steps over the context, with the secret's positions shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers, heads = len(weights[0]), len(weights[0][0])
    fig, axes = plt.subplots(
        layers, heads, figsize=(3.2 * heads, 2.0 * layers), squeeze=False, sharex=True, sharey=True
    )
    for layer in range(layers):
        for head in range(heads):
            ax = axes[layer][head]
            ax.axvspan(secret_span[0] - 0.5, secret_span[1] - 0.5, color="orange", alpha=0.25)
            for step, w in enumerate(weights):
                ax.plot(w[layer][head], linewidth=0.9, label=f"answer step {step + 1}")
            ax.set_title(f"layer {layer} head {head}", fontsize=8)
            ax.tick_params(labelsize=6)
    axes[0][0].legend(fontsize=6)
    fig.suptitle(title + "  (shaded: own secret's positions)", fontsize=9)
    fig.supxlabel("context position", fontsize=8)
    fig.supylabel("attention weight", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
