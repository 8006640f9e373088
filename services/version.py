"""This ringwatch's version: in a source tree, its pyproject's; installed (the wheel an image
holds), its package metadata's. ``ringwatch --version``, the API's OpenAPI document and the
image tags carry it."""

from __future__ import annotations

import functools
import tomllib
from importlib import metadata
from pathlib import Path

# Beside the packages in a source tree only: a wheel installs no pyproject.
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


@functools.cache
def ringwatch_version() -> str:
    # The source tree's pyproject first: the metadata of an editable install (or an old
    # ringwatch.egg-info on the path) says the version of its last `pip install`, not the
    # code that runs.
    try:
        with PYPROJECT.open("rb") as f:
            project = tomllib.load(f).get("project", {})
        if project.get("name") == "ringwatch":
            return str(project["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        pass
    try:
        return metadata.version("ringwatch")
    except metadata.PackageNotFoundError:
        return "unknown"
