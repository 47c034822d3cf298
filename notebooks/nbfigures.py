"""Saving a notebook's figures for the chapters (chapters/figures/).

A notebook draws its figures as usual and calls save_figure(fig, "06_shard_layout.png")
after each one the chapter shows. The file is written only when the notebook runs under
scripts/run_notebooks.py (which sets MINIDIST_FIGURES=1), so that the figures a chapter
shows come from the same run as the stored notebook's outputs; the tests, which run the
notebooks at their quick size, write nothing.
"""

from __future__ import annotations

import io
import os
import pathlib

from PIL import Image  # matplotlib's own dependency

FIGURES = pathlib.Path(__file__).resolve().parent.parent / "chapters" / "figures"
DPI = 120  # sharp on a page (at least 110), under 200 kB per image


def save_figure(fig, name: str) -> None:
    """Write `fig` to chapters/figures/`name` (a .png) when MINIDIST_FIGURES=1."""
    if not name.endswith(".png"):
        raise ValueError(f"figure names end in .png, got {name!r}")
    if os.environ.get("MINIDIST_FIGURES") == "1":
        FIGURES.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
        # a plot has few colours: a 256-colour palette looks the same at a third of the bytes
        image = Image.open(buf).convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT,
                                                        dither=Image.Dither.NONE)
        image.save(FIGURES / name, format="PNG", optimize=True, dpi=(DPI, DPI))
