"""The one error for bad topology specs and scenario files."""

from __future__ import annotations

from pydantic import ValidationError


class SpecError(ValueError):
    """A topology spec or scenario that cannot be used; the message names the file and key path."""

    @classmethod
    def from_validation(cls, error: ValidationError, source: str, union_tags: tuple[str, ...] = ()) -> SpecError:
        """One line per problem, `path.to[3].key: message`; `union_tags` (pydantic's names for the
        member of a tagged union, e.g. a step kind) are left out of the path."""
        lines = []
        for problem in error.errors():
            loc = problem["loc"]
            parts = [p for i, p in enumerate(loc) if not (p in union_tags and i and isinstance(loc[i - 1], int))]
            path = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in parts)
            path = path.lstrip(".") or "(top level)"
            lines.append(f"  {path}: {problem['msg']}")
        return cls(f"{source} is not valid:\n" + "\n".join(lines))
