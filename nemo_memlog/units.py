"""The units rule: a size in GB as every output shows it (tables, sentences, PNGs, the advice)."""

from __future__ import annotations

import math


def size_text(gb: float | None, short: bool = False) -> str:
    """The units rule: a size in GB as every output shows it, MB below 1 GB, GB from 1 GB.

    "1.84 GB", "543 MB", "8.4 MB", "0.47 MB", "0 MB"; "-" for none. GB with two decimals; MB
    whole from 10 MB, else two significant digits, so a small model's state never reads "0.00"
    and no part below 10 MB is rounded away. ``report``, ``advise``, ``postmortem`` and their PNGs
    all format sizes through here (advice.fmt too). ``short`` (a sentence): GB to two significant
    digits, "61 GB", "1.3 GB"; MB as above."""
    if gb is None or (isinstance(gb, float) and not math.isfinite(gb)):
        return "-"
    if abs(gb) >= 0.9995:  # what would round to "1000 MB" reads "1.00 GB"
        if short:
            return f"{gb:.0f} GB" if abs(gb) >= 9.95 else f"{gb:.1f} GB"
        return f"{gb:.2f} GB"
    mb = gb * 1000
    if mb == 0:
        return "0 MB"
    if abs(mb) >= 10:
        return f"{mb:.0f} MB"
    if abs(mb) >= 0.01:
        return f"{float(f'{mb:.2g}'):g} MB"
    return f"{'-' if mb < 0 else ''}<0.01 MB"
