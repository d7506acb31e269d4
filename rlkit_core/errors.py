"""Errors a user can act on. The CLI prints them without a traceback and picks the exit code."""

from __future__ import annotations

import attrs


@attrs.frozen
class Problem:
    """One thing wrong with a recipe: where it is (`$.reward.parts[1].weight`) and what, ending with the fix."""

    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


class RlkitError(Exception):
    """Base class: a problem the user can fix. Exit code 2 (bad input) unless a subclass says otherwise."""

    exit_code = 2


class RecipeError(RlkitError):
    """One or more located problems in a recipe, reported together.

    Each problem reads `$.path.to.key: what is wrong` so the user can find it in the file; give
    `Problem` records or strings already in that form.
    """

    def __init__(self, problems, source=None):
        self.problems = [str(p) for p in problems]
        self.source = source
        where = f"{source}: " if source else ""
        lines = "\n".join(f"  {p}" for p in self.problems)
        count = len(self.problems)
        super().__init__(f"{where}{count} problem{'s' if count != 1 else ''} in the recipe:\n{lines}")


class PluginError(RlkitError):
    """A plugin is broken or conflicts with another (duplicate name, misspelled hook, import failure)."""


class BrokenPluginContract(PluginError):
    """One plugin's own component breaks the plugin contract; that plugin is broken, the others load."""


class RunError(RlkitError):
    """A failure while training that is not the recipe's fault (exit code 1)."""

    exit_code = 1


class RecipeDeprecation(FutureWarning):
    """A recipe setting that still works under an earlier name; the CLI prints it as one plain line."""
