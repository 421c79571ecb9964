"""The one error for bad topology specs and scenario files."""

from __future__ import annotations

from pydantic import ValidationError


class SpecError(ValueError):
    """A topology spec or scenario that cannot be used; the message names the file and key path."""

    @classmethod
    def from_validation(cls, error: ValidationError, source: str) -> SpecError:
        lines = []
        for problem in error.errors():
            path = ".".join(str(part) for part in problem["loc"]) or "(top level)"
            lines.append(f"  {path}: {problem['msg']}")
        return cls(f"{source} is not valid:\n" + "\n".join(lines))
