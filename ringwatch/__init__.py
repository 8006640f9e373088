"""ringwatch: a health monitor for the communication fabric of GPU training clusters.

Everything ringwatch installs lives under this one name: ``ringwatch.agents`` (what runs on
a GPU node), ``ringwatch.services`` (scheduler, analyzer, store, notifier, CLI),
``ringwatch.api`` (the HTTP API) and ``ringwatch.migrations``. In the repository they are
the top-level folders of the same names (this folder links to them); an installed wheel
holds them here (pyproject.toml maps them).
"""
