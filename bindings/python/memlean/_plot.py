"""PNG plots (matplotlib, an optional dependency): memstats' Tracker.plot and the
experiments' figures draw through here."""
import math
import os


def pyplot(who: str, otherwise: str = ""):
    """matplotlib.pyplot on the Agg backend (files only, no display), or an ImportError that
    says who needs it and what to do."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(f"{who} needs matplotlib, an optional dependency of memlean; "
                          f"install it (pip install matplotlib){otherwise}") from e
    return plt


def save(fig, path) -> str:
    """Writes `fig` as a PNG at `path` (its folder made if missing), closes it, returns the
    path."""
    plt = pyplot("memlean's plotting")
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
    return path


# One line style and marker per measure (or configuration); colours come from matplotlib's
# default cycle, one per variant.
STYLES = (("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ((0, (5, 1, 1, 1)), "v"))


def panels(path: str, title: str, panels: list, xticks: list | None = None,
           log: bool = False) -> str:
    """A PNG of one or more side-by-side panels (an ImportError without matplotlib).
    panels = [(xlabel, ylabel, series)], series = {(variant, measure):
    (xs, ys)} or (xs, ys, point labels). A variant keeps one colour and a measure one line
    style in every panel, and the legend lists colours and styles apart, so that each line
    reads as 'variant, measure' however many there are. xticks: ticks at these x (batch
    sizes); log: both axes logarithmic."""
    plt = pyplot("memlean's plotting")
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter
    variants, measures = [], []
    for _, _, series in panels:
        for v, m in series:
            variants += [v] if v not in variants else []
            measures += [m] if m not in measures else []
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colour = {v: colours[i % len(colours)] for i, v in enumerate(variants)}
    style = {m: STYLES[i % len(STYLES)] for i, m in enumerate(measures)}
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.6), squeeze=False)
    for ax, (xlabel, ylabel, series) in zip(axes[0], panels):
        for (v, m), (xs, ys, *labels) in series.items():
            line, marker = style[m]
            ax.plot(xs, ys, linestyle=line, marker=marker, color=colour[v])
            for x, y, text in zip(xs, ys, labels[0] if labels else []):
                ax.annotate(str(text), (x, y), textcoords="offset points", xytext=(4, 4),
                            fontsize=7)
        if log:  # plain numbers on the ticks, not powers of ten; minor ones at 2x and 5x only
            for axis, scale in ((ax.xaxis, ax.set_xscale), (ax.yaxis, ax.set_yscale)):
                scale("log")
                axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
                axis.set_minor_formatter(FuncFormatter(
                    lambda v, _: f"{v:g}" if round(v / 10 ** math.floor(math.log10(v))) in (2, 5)
                    else ""))
        if xticks:
            ax.set_xticks(xticks)
            ax.set_xticklabels([str(x) for x in xticks])
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    handles = [Line2D([], [], color=colour[v], linewidth=2.5, label=v) for v in variants]
    if len(measures) > 1:
        handles += [Line2D([], [], color="0.3", linestyle=style[m][0], marker=style[m][1], label=m)
                    for m in measures]
    axes[0][-1].legend(handles=handles, fontsize=8, loc="best")
    fig.suptitle(title)
    fig.tight_layout()
    return save(fig, path)
