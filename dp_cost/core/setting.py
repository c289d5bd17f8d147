"""One row of the settings table (``core.settings``): a setting's name, defaults, flags, how it
names the config directory and compares results, and where it takes effect (``core.scopes``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dp_cost.core.scopes import Scope


@dataclass(frozen=True)
class Setting:
    name: str  # ExperimentConfig field and result["config"] key
    default: Any
    help: str = ""
    flags: tuple[str, ...] = ()  # CLI spellings, canonical first; none: set by the plan only
    type: Callable | None = None
    choices: tuple | None = None
    axis: bool = False  # the flag takes several values: one config per value
    many: bool = False  # the flag takes several values, all of them in every config
    switch: bool | None = None  # a value-less flag: the value it sets (True, or False for --no_x)
    modes: dict = field(default_factory=dict)  # default per mode, where it differs
    # This setting's part of the config directory name (None or "" when it adds none).
    dir_part: Callable[[Any], str | None] | None = None
    compare: bool = False  # reports compare trainers among configs equal in every such setting
    # Where a result's config keeps the compared value (default: the setting's own key).
    compared_value: Callable[[dict], Any] | None = None
    into: str | None = None  # collected into this dict field (model overrides) instead
    recorded: bool = True  # False: plan-internal, not written to result.json
    # Its mode default follows the mode that runs, not the defaults a GPU mode borrows on CPU.
    follows_mode: bool = False
    scope: Scope | None = None  # where it takes effect when given (None: everywhere)

    @property
    def dest(self) -> str:
        return self.flags[0].lstrip("-").replace("-", "_") if self.flags else self.name

    def default_for(self, mode: str | None) -> Any:
        return self.modes.get(mode, self.default)

    def value_in(self, config: dict) -> Any:
        if self.compared_value is not None:
            return self.compared_value(config)
        return config.get(self.name, self.default)
