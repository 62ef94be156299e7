"""Draw the documentation's pictures (run from the repository root: python docs/img/make_figures.py).

partition.png: how one epoch's global order is cut into global steps of R × B samples, each rank
taking its slice of every step, and how a rank's batches go round-robin to its DataLoader workers.
It is drawn from datapipe.partition itself, so the picture is what the code does.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from datapipe import partition as part

HERE = Path(__file__).parent


def partition_png(num_samples: int = 22, batch_size: int = 3, world_size: int = 2, num_workers: int = 2) -> Path:
    order = part.epoch_order(num_samples, seed=0, epoch=0, shuffle=True)
    colours = ["#4C72B0", "#DD8452"]
    hatches = ["", "//"]
    fig, ax = plt.subplots(figsize=(11, 3.2))
    for rank in range(world_size):
        bounds = part.batch_bounds(num_samples, batch_size=batch_size, world_size=world_size, rank=rank, drop_last=False)
        for j, (begin, end) in enumerate(bounds):
            worker = j % num_workers  # part.worker_batches: batch j goes to worker j mod W
            for pos in range(begin, end):
                ax.add_patch(Rectangle((pos, 1), 0.95, 0.9, facecolor=colours[rank], hatch=hatches[worker],
                                       edgecolor="white", alpha=0.9))
                ax.text(pos + 0.47, 1.45, str(order[pos]), ha="center", va="center", color="white", fontsize=9)
            ax.text((begin + end) / 2, 0.75, f"r{rank} b{j}", ha="center", va="center", fontsize=8)
    step = batch_size * world_size
    for s in range(0, num_samples + 1, step):
        ax.plot([s - 0.025] * 2, [0.6, 2.0], color="black", lw=1)
    ax.text(0, 2.25, f"one epoch's global order (a permutation of {num_samples} sample indices, a function of seed and epoch), "
            f"cut into global steps of R × B = {world_size} × {batch_size}", fontsize=9)
    handles = [Rectangle((0, 0), 1, 1, facecolor=colours[r]) for r in range(world_size)]
    handles += [Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="grey", hatch=hatches[w]) for w in range(num_workers)]
    labels = [f"rank {r}" for r in range(world_size)] + [f"DataLoader worker {w} (batch j → worker j mod W)" for w in range(num_workers)]
    ax.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False, bbox_to_anchor=(0.5, -0.32))
    ax.set_xlim(-0.5, num_samples + 0.5)
    ax.set_ylim(0.4, 2.5)
    ax.axis("off")
    ax.set_title("The last, partial step is split as evenly as possible: every sample once, equal batch counts on every rank",
                 fontsize=9, y=-0.12)
    out = HERE / "partition.png"
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


if __name__ == "__main__":
    print(partition_png())
