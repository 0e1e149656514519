"""One exception type for everything the user must fix, formatted the same way everywhere."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Problem", "QuantizeError"]


@dataclass(frozen=True)
class Problem:
    """One offending file/tensor: what we found, what we expected, how to fix it."""

    file: str
    tensor: str | None
    found: str
    expected: str
    fix: str

    def __str__(self) -> str:
        where = self.file if self.tensor is None else f"{self.file} :: {self.tensor}"
        return f"{where}: {self.found} (expected {self.expected}). Fix: {self.fix}"


@dataclass
class QuantizeError(Exception):
    """Raised before any output is written when the input cannot be converted.

    Carries every problem found, not just the first, so one run lists them all.
    """

    summary: str
    problems: list[Problem] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [self.summary]
        shown = self.problems[:20]
        lines += [f"  - {p}" for p in shown]
        if len(self.problems) > len(shown):
            lines.append(f"  ... and {len(self.problems) - len(shown)} more of the same kind")
        return "\n".join(lines)
