"""The command line's argument types: each a checked number, or argparse's error saying what to write."""

from __future__ import annotations

import argparse
import math


def fraction(text: str) -> float:
    """An argparse type: a number from 0 up to (not including) 1."""
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a share from 0 up to 1 (0.1 is 10%) is expected")
    return value


def whole(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number >= 1 is expected")
    return value


def seconds(text: str) -> float:
    """An argparse type: a finite number of seconds >= 0."""
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: a number of seconds >= 0 is expected")
    return value


def gigabytes(text: str) -> float:
    """An argparse type: a finite number of GB above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: a number of GB above 0 is expected")
    return value
