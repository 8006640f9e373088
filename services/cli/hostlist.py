"""Slurm's compressed host lists for the command line: the parser lives in agents.hostlist
(the sim's scenario jobs read host lists too, and agents import nothing from services)."""

from __future__ import annotations

from ringwatch.agents.hostlist import MAX_HOSTS, expand_hostlist, expand_hostlists, split_top

__all__ = ["MAX_HOSTS", "expand_hostlist", "expand_hostlists", "split_top"]
