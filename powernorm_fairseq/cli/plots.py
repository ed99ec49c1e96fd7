"""The figures' helpers every command shares (the study's, the tables', powernorm-analyze's)."""

import logging

from ..common.files import atomic_path


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display), its import's debug log silenced."""
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # before the import, which logs at DEBUG
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path, plt):
    """Write ``fig`` to ``path`` whole or not at all (a temporary file renamed), and close it; the image
    holds everything drawn, a legend beside the panels too."""
    try:
        with atomic_path(path, suffix=".png") as tmp:
            fig.savefig(tmp, dpi=120, bbox_inches="tight")
    finally:
        plt.close(fig)
    return path


def plain_log_ticks(ax):
    """A log y axis's tick labels as plain numbers ("0.5", "2", "1e+12"), not "5 x 10^-1"; the minor
    ticks labelled only where the axis spans less than a decade (else they crowd). Call it once drawn."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    plain = FuncFormatter(lambda value, _: f"{value:g}")
    low, high = ax.get_ylim()
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain if 0 < low and high / low < 10 else NullFormatter())
