"""Optional dependencies (extras): a missing one is a one-line error naming the extra to
install, never an ImportError traceback from deep inside a command."""

from __future__ import annotations

import importlib
from types import ModuleType

# module -> the extra of pyproject.toml that installs it
EXTRAS = {"ray": "ray", "playwright": "test", "mkdocs": "docs"}


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message says how to install it."""


def require(module: str, feature: str) -> ModuleType:
    """Import `module` for `feature` (e.g. "--ray"), or raise MissingExtra naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        extra = EXTRAS.get(module.split(".")[0], module)
        raise MissingExtra(f"{feature} needs the optional dependency {module!r} ({e}): "
                           f"pip install 'flowyard[{extra}]' (or: pip install {module})") from None
