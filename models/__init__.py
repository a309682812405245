"""Bundled model weights (package data): `pydoc-llama`, the default model of every command.

Found with importlib.resources, so it works from a source checkout, an editable install and a
wheel alike.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

BUNDLED = "pydoc-llama"


def bundled_model_dir() -> Path:
    """The bundled model's directory on disk (package data is installed as plain files)."""
    return Path(str(resources.files(__name__).joinpath(BUNDLED)))
