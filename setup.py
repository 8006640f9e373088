"""The package list pyproject.toml's package-dir maps: every package under agents, services,
api and migrations, installed under ringwatch.* (setuptools cannot discover mapped packages
from pyproject.toml alone)."""

from setuptools import find_namespace_packages, setup

TOPS = ("agents", "services", "api", "migrations")
packages = ["ringwatch"]
for top in TOPS:
    found = find_namespace_packages(top, exclude=["*__pycache__*"])
    packages += [f"ringwatch.{top}"] + [f"ringwatch.{top}.{p}" for p in found]

setup(packages=packages)
