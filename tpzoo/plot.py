"""Training curves of one or more runs as a PNG: ``python -m tpzoo.plot RUN_DIR [RUN_DIR ...] -o curves.png``.

A RUN_DIR is a ``--save`` folder, a ``--log-dir``, or a ``metrics.jsonl`` file (``tpzoo.training.metrics``).
Four panels against the iteration: the loss (train as a line, validation as markers of the same
colour), the learning rate, the gradient norm and tokens/s; one colour per run, named in the legend
by its folder. Runs of a mixture of experts (``tokens_per_expert`` in their lines) add two: the expert load's
imbalance against the iteration (each layer's busiest expert's tokens over the mean expert's, averaged over the
layers: 1 when balanced) and, for the first such run, each layer's share of tokens per expert at its last line.
Needs matplotlib (``pip install 'tpzoo[monitor]'``); draws with the Agg backend (no display).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from tpzoo.training.args import command_parser, exit_on_misuse
from tpzoo.training.monitor import require

PROG = "python -m tpzoo.plot"
# (panel title, metrics.jsonl field, log scale)
PANELS = [("loss", "loss", False), ("learning rate", "lr", False), ("grad norm", "grad_norm", True),
          ("tokens/s", "tokens_per_sec", False)]


def metrics_file(path: str) -> Path:
    """The metrics.jsonl that ``path`` names (itself, or the one in that folder); FileNotFoundError if none."""
    p = Path(path)
    if p.is_file():
        return p
    if (p / "metrics.jsonl").is_file():
        return p / "metrics.jsonl"
    what = "does not exist" if not p.exists() else "holds no metrics.jsonl"
    raise FileNotFoundError(f"{path} {what}; pass a run's --save or --log-dir folder, or its metrics.jsonl")


def read_records(path: Path) -> list[dict[str, Any]]:
    """The lines of a metrics.jsonl (a line cut short by a killed run is left out); ValueError if none."""
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    records = [r for r in records if isinstance(r, dict) and "iteration" in r]
    if not records:
        raise ValueError(f"{path} holds no metrics lines; is it a tpzoo run's metrics.jsonl?")
    return records


def run_name(path: Path) -> str:
    """The legend's name of the run logged in ``path``: its folder's name."""
    return path.resolve().parent.name


def series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(iterations, values) of the lines where ``key`` is a number."""
    points = [(r["iteration"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [i for i, _ in points], [v for _, v in points]


def imbalance(records: list[dict[str, Any]]) -> tuple[list[int], list[float]]:
    """(iterations, the mean over layers of max / mean tokens per expert) of the lines with ``tokens_per_expert``."""
    points = [(r["iteration"], sum(max(row) * len(row) / sum(row) for row in table) / len(table))
              for r in records if (table := [row for row in r.get("tokens_per_expert") or [] if sum(row)])]
    return [i for i, _ in points], [v for _, v in points]


def check_output(output: str, flag: str = "-o") -> None:
    """ValueError naming ``flag`` unless ``output`` can be written: a .png in an existing, writable folder."""
    folder = Path(output).parent
    if not output.lower().endswith(".png"):
        raise ValueError(f"{flag} {output}: the picture is a PNG; name it ...png")
    if not folder.is_dir() or not os.access(folder, os.W_OK) or Path(output).is_dir():
        raise ValueError(f"{flag} {output} cannot be written (folder {folder} missing or not writable); "
                         f"pass a path in a writable folder")


def plot(runs: dict[str, list[dict[str, Any]]], output: str) -> None:
    """Draw the four panels of ``runs`` (name -> metrics lines) into the PNG ``output``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    experts = {name: records for name, records in runs.items() if imbalance(records)[0]}
    fig, axes = plt.subplots(3 if experts else 2, 2, figsize=(10, 9.5 if experts else 6.5), dpi=100)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, (name, records) in enumerate(runs.items()):
        colour = colours[k % len(colours)]
        if name in experts:
            axes.flat[4].plot(*imbalance(records), color=colour, linewidth=1.5)
        for ax, (title, key, log) in zip(axes.flat, PANELS):
            ax.plot(*series(records, key), color=colour, label=name if key == "loss" else None, linewidth=1.5)
            if key == "loss":
                iters, vals = series(records, "val_loss")
                ax.plot(iters, vals, "o", color=colour, markersize=5, label=f"{name} (validation)")
            ax.set_title(title)
            ax.set_yscale("log" if log else "linear")
    if experts:
        name, records = next(iter(experts.items()))
        iteration, table = [(r["iteration"], r["tokens_per_expert"]) for r in records if r.get("tokens_per_expert")][-1]
        shares = [[v / max(sum(row), 1) for v in row] for row in table]
        image = axes.flat[5].imshow(shares, aspect="auto", cmap="viridis")
        fig.colorbar(image, ax=axes.flat[5], label="share of the layer's tokens")
        axes.flat[5].set(title=f"{name}: tokens per expert, iteration {iteration}", xlabel="expert", ylabel="layer")
        axes.flat[4].set_title("expert load: busiest / mean expert")
    for ax in axes.flat[:5 if experts else 4]:
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(output)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = command_parser(PROG, "Training curves of one or more runs (loss, validation loss, lr, grad norm, "
                            "tokens/s against iterations) as a PNG.")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="a --save or --log-dir folder, or a metrics.jsonl")
    parser.add_argument("-o", "--output", default="curves.png", help="the PNG to write")
    args = parser.parse_args(argv)

    def load() -> dict[str, list[dict[str, Any]]]:
        require("matplotlib", PROG)
        check_output(args.output)
        files = [metrics_file(run) for run in args.runs]
        names = [run_name(f) for f in files]
        if len(set(names)) < len(names):  # two runs in folders of the same name: name them by their paths
            names = [str(f.parent) for f in files]
        return {name: read_records(f) for name, f in zip(names, files)}

    runs = exit_on_misuse(PROG, load)
    plot(runs, args.output)
    print(f"{args.output}: {', '.join(f'{name} ({len(r)} lines)' for name, r in runs.items())}", file=sys.stdout)


if __name__ == "__main__":
    main()
