"""A benchmark suite's TOML file (recipes/bench/suites/, the format in recipes.bench.suite's
docstring) read into a Suite: its includes' workloads first, every ${NAME} but the launch-time
ones resolved from the suite's [vars], its includes' and --set, so that an unknown key or an
unset variable is refused before anything runs; and a workload's flags turned into a launch's
arguments once the launch-time names (${nproc}, captured values) are known."""

import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from string import Template

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

SUITES = Path(__file__).with_name("suites")
KEYS = {"name", "module", "code", "torchrun", "flags", "variants", "limit", "launches", "ngpu",
        "first_fitting", "global_batch", "largest", "peak", "env", "show", "capture", "default",
        "required", "pythonpath"}
RUNTIME_VARS = {"nproc"}
_WHOLE = re.compile(r"\$\{(\w+)\}")


class SuiteError(Exception):
    """A suite file that cannot run as written (before anything runs)."""


@dataclass
class Suite:
    name: str
    description: str
    workloads: list[dict]
    seconds: float | None = None
    shared_deadline: str | None = None
    vars: dict = field(default_factory=dict)
    """Its variables as resolved (an including suite's defaults)."""


def suite_path(name: str) -> Path:
    """A suite's file: recipes/bench/suites/NAME.toml where there is one (NAME may name its
    subfolder: `vars/h2h`, variables that several suites include), else a path as given."""
    path, shipped = Path(name), SUITES / f"{name}.toml"
    if path.suffix == ".toml" or (os.sep in name and not shipped.is_file()):
        return path
    return shipped


def shipped_suites() -> dict[str, str]:
    """The suites under recipes/bench/suites/, by name, with what each measures."""
    return {path.stem: tomllib.loads(path.read_text()).get("description", "")
            for path in sorted(SUITES.glob("*.toml"))}


def _value(text: str):
    """--set's VALUE: a TOML value ([8, 4], 550, true), else the string as written."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_sets(pairs: list[str]) -> dict[str | None, dict]:
    """--set [SUITE.]NAME=VALUE pairs, by suite (None: every suite)."""
    sets: dict[str | None, dict] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise SuiteError(f"--set {pair!r}: expected [SUITE.]NAME=VALUE")
        suite, _, name = key.rpartition(".")
        sets.setdefault(suite or None, {})[name] = _value(text)
    return sets


def _substitute(value, names: dict, path: str):
    """`value` with ${NAME} replaced (a string that is one ${NAME} takes the variable's own
    type); names not known yet (${nproc}, captured ones) are left for the launch."""
    if isinstance(value, dict):
        return {k: _substitute(v, names, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, names, f"{path}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value
    whole = _WHOLE.fullmatch(value)
    if whole and whole[1] in names and names[whole[1]] is not None:
        return names[whole[1]]
    for ref in _WHOLE.findall(value):
        if ref not in names:
            raise SuiteError(f"{path}: ${{{ref}}} is not set (--set {ref}=VALUE)")
    return Template(value).safe_substitute({k: _text(v) for k, v in names.items() if v is not None})


def _text(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def load_suite(name: str, sets: dict[str | None, dict], builtins: dict,
               _seen: tuple[str, ...] = ()) -> Suite:
    """A suite file, its includes' workloads first, every ${NAME} but the launch-time ones
    resolved; SuiteError for an unknown key or an unset variable."""
    path = suite_path(name)
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in SUITES.glob("*.toml")))
        raise SuiteError(f"no suite {name!r} ({path}); shipped: {known}")
    stem = path.stem
    if stem in _seen:
        raise SuiteError(f"{path}: includes itself through {' -> '.join(_seen)}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise SuiteError(f"{path}: {e}") from None
    unknown = set(data) - {"description", "seconds", "shared_deadline", "include", "vars",
                           "workload"}
    if unknown:
        raise SuiteError(f"{path}: unknown key {sorted(unknown)[0]!r}")
    included = [load_suite(n, sets, builtins, (*_seen, stem)) for n in data.get("include", [])]
    names = dict(builtins)
    for inc in included:  # an included suite's variables are this one's defaults
        names.update(inc.vars)
    names.update(data.get("vars", {}))
    names.update(sets.get(None, {}), **sets.get(stem, {}))
    captured = {w["capture"] for w in data.get("workload", []) if "capture" in w}
    for n in RUNTIME_VARS | captured:
        names.setdefault(n, None)
    for _ in range(4):  # variables made of variables, after --set
        names = {k: _substitute(v, names, f"{path}: vars.{k}") if k not in builtins else v
                 for k, v in names.items()}
    workloads = [w for inc in included for w in inc.workloads]
    for i, raw in enumerate(data.get("workload", [])):
        where = f"{path}: workload {raw.get('name', i + 1)!r}"
        bad = set(raw) - KEYS
        for variant in raw.get("variants", []):
            if isinstance(variant, dict):
                bad |= set(variant) - KEYS
        if bad:
            raise SuiteError(f"{where}: unknown key {sorted(bad)[0]!r}")
        if "name" not in raw:
            raise SuiteError(f"{where}: no name")
        workloads.append(dict(_substitute(raw, names, where), suite=stem))
    seconds = names.get("seconds", data.get("seconds"))
    return Suite(stem, data.get("description", ""), workloads,
                 float(seconds) if seconds is not None else None, data.get("shared_deadline"),
                 {k: v for k, v in names.items() if k not in builtins})


def flag_args(value, names: dict | None = None) -> list[str]:
    """A workload's flags as arguments: a string split as a shell would, a list item by item;
    launch-time ${NAME} resolved from `names`."""
    if value is None:
        return []
    names = {k: _text(v) for k, v in (names or {}).items()}
    if isinstance(value, str):
        return shlex.split(Template(value).safe_substitute(names))
    return [Template(str(v)).safe_substitute(names) for v in value]
