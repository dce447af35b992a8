"""The one error type a config problem raises: every issue names a key path."""

from __future__ import annotations

from collections.abc import Sequence

from primus.core.contracts.errors import UserError
from primus.core.contracts.protocols import ConfigIssue


class ConfigError(UserError, ValueError):
    def __init__(self, issues: Sequence[ConfigIssue]):
        self.issues = list(issues)
        super().__init__(self.render())

    def render(self) -> str:
        head = "invalid config" if len(self.issues) == 1 else f"invalid config ({len(self.issues)} problems)"
        return head + ":\n" + "\n".join(f"  - {issue}" for issue in self.issues)

    @property
    def paths(self) -> list[str]:
        return [issue.path for issue in self.issues]
