"""Numeric bounds declared on a config field, `Annotated[int, at_least(1)]`, so that a field's
limits sit with its type and docstring. Both layers' config sections use them (recipes/config.py
checks every field against its type, choices and bounds before any work starts); tyro, which
parses the command line, ignores the marker."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_type_hints


@dataclass(frozen=True)
class Bound:
    """What a field's value must satisfy (`holds`), as an error says it (`says`)."""

    holds: Callable[[float], bool]
    says: str


def at_least(low: float) -> Bound:
    return Bound(lambda v: v >= low, f">= {low:g}")


def above(low: float) -> Bound:
    return Bound(lambda v: v > low, f"> {low:g}")


def within(low: float, high: float, *, high_open: bool = False, low_open: bool = False) -> Bound:
    """low..high, each end closed unless said open."""
    def holds(v: float) -> bool:
        return (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
    return Bound(holds, f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}")


UNSET_OR_AT_LEAST_1 = Bound(lambda v: v == 0 or v >= 1, "0 (the model's) or >= 1")
"""A scaling factor: 0 takes the model's own."""


def bound_error(key: str, value: float, annotation: Any) -> str | None:
    """What `value` breaks of the Bound markers on `annotation` (a field's Annotated type), said
    as the error for `key`; None when it keeps them."""
    for bound in getattr(annotation, "__metadata__", ()):
        if isinstance(bound, Bound) and not bound.holds(value):
            return f"{key} must be {bound.says}, got {value!r}"
    return None


def check_field(cls: type, name: str, value: float, *, key: str) -> None:
    """ValueError where `value` breaks the bounds of `cls`'s field `name` (a setting changed
    after the config was checked)."""
    error = bound_error(key, value, get_type_hints(cls, include_extras=True)[name])
    if error:
        raise ValueError(error)
