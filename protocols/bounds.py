"""Config sections that check themselves: a field's type, `Literal` choices and numeric bounds
(`Annotated[int, at_least(1)]`; a list's on its item type) sit on the field, and a section that
derives from `Checked` holds its values to them whenever it is built: from TOML, from tyro's
command line, or in code.
Both layers' config sections use it (recipes/job_config.py, slidedp/config.py)."""

import math
import types
from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import cache
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints


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


class FieldError(Exception):
    """A section's field holds a value its annotation refuses. Not a ValueError, so that tyro
    lets it through to the caller, which names the section (recipes/config.py)."""

    def __init__(self, owner: type, message: str):
        super().__init__(message)
        self.owner = owner
        """The section class."""
        self.message = message
        """The error, starting with the field's name."""


def _type_name(tp: Any) -> str:
    if get_origin(tp) is list:
        return f"a list, each item {_type_name(base_type(get_args(tp)[0]))}"
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(c) for c in get_args(tp))
    if get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string",
            type(None): "unset"}.get(tp, str(tp))


def _matches(value: Any, tp: Any) -> bool:
    """TOML-strict type check: bool is not an int, an int is a valid float."""
    origin = get_origin(tp)
    if origin is Literal:
        return any(type(value) is type(c) and value == c for c in get_args(tp))
    if origin in (Union, types.UnionType):
        return any(_matches(value, a) for a in get_args(tp))
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is type(None):
        return value is None
    return isinstance(value, tp)


def base_type(tp: Any) -> Any:
    """The type under an Annotated one (its bounds stripped)."""
    return get_args(tp)[0] if get_origin(tp) is Annotated else tp


def field_error(name: str, value: Any, annotation: Any) -> str | None:
    """What `value` breaks of `annotation` (a field's type, its choices, its Bound markers),
    said as the error for the field `name`; None when it keeps them."""
    base = base_type(annotation)
    if get_origin(base) is list:  # a list's items are held to the item annotation
        if not isinstance(value, list):
            return f"{name} must be {_type_name(base)}, got {value!r}"
        item = get_args(base)[0]
        return next(filter(None, (field_error(f"{name}[{i}]", v, item)
                                  for i, v in enumerate(value))), None)
    if not _matches(value, base):
        return f"{name} must be {_type_name(base)}, got {value!r}"
    if isinstance(value, float) and not math.isfinite(value):  # inf passes every bound
        return f"{name} must be finite, got {value!r}"
    return _bound_error(name, value, annotation)


def _bound_error(name: str, value: float, annotation: Any) -> str | None:
    for bound in getattr(annotation, "__metadata__", ()):
        if isinstance(bound, Bound) and not bound.holds(value):
            return f"{name} must be {bound.says}, got {value!r}"
    return None


@cache
def field_types(cls: type) -> dict[str, Any]:
    """`cls`'s fields and their annotations, bounds included."""
    return get_type_hints(cls, include_extras=True)


class Checked:
    """A dataclass whose fields are held to their annotations when it is built (an int given
    for a float field is widened); a refused value is a FieldError."""

    def __post_init__(self) -> None:
        hints = field_types(type(self))
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if error := field_error(f.name, value, hints[f.name]):
                raise FieldError(type(self), error)
            if base_type(hints[f.name]) is float:
                setattr(self, f.name, float(value))


def check_field(cls: type, name: str, value: float, *, key: str) -> None:
    """ValueError where `value` breaks the bounds of `cls`'s field `name` (a setting changed
    after the config was built)."""
    if error := _bound_error(key, value, field_types(cls)[name]):
        raise ValueError(error)
