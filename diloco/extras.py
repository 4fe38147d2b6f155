"""Optional dependency sets: the base install runs the syncer and the operator; training needs
the `learner` extra (JAX and the rest). One source of truth: the extra's list in the package's
own metadata (pyproject.toml), so a command that needs it names exactly what is missing."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re

DISTRIBUTION = "decoupled-diloco"
LEARNER = "learner"
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)[^;]*;\s*extra\s*==\s*['\"]([^'\"]+)['\"]\s*$")


def modules(extra: str) -> tuple[str, ...]:
    """The importable names of an extra's distributions (each is its distribution's name here);
    () where the package's metadata is not installed (running from a bare source tree)."""
    try:
        requires = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return ()
    names = []
    for line in requires:
        match = _REQUIREMENT.match(line)
        if match and match.group(2) == extra and match.group(1) != DISTRIBUTION:
            names.append(match.group(1).replace("-", "_"))
    return tuple(names)


def missing(extra: str) -> list[str]:
    """The extra's modules that cannot be imported here."""
    return [m for m in modules(extra) if importlib.util.find_spec(m) is None]


def missing_message(command: str, extra: str, absent: list[str]) -> str:
    return (f"diloco {command}: needs the {extra!r} extra, and {', '.join(absent)} cannot be imported here. "
            f"Install it with: pip install '{DISTRIBUTION}[{extra}]' (the syncer image has no JAX: "
            f"run learners from the learner image)")
