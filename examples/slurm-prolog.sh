#!/bin/sh
# Slurm prolog: before a job starts on this node, ask ringwatch about this node alone
# (SLURMD_NODENAME). Where ringwatch excludes it, the node is drained with the finding as
# its reason (`sinfo -R`: "ringwatch: nvlink_degraded node-017 GPUs 2,5 allreduce ...") and
# the prolog exits 1, so the job does not start here; a healthy node exits 0 and is left
# alone. When ringwatch cannot answer (API down, 429, 503, no verdict in time) the job
# starts (RINGWATCH_SLURM_ON_ERROR=closed drains instead), within 30 s in all.
#
#   Prolog=/etc/slurm/prolog.d/ringwatch.sh        in slurm.conf
#   PrologFlags=Alloc
#
# slurmd runs a prolog with no PATH and none of your RINGWATCH_* variables: the paths below
# are absolute, and the API URL and token are read from the env file (mode 0600, owned by
# root). Install and settings: docs/slurm.md; the way back: examples/slurm-resume.cron.
RINGWATCH=/opt/ringwatch/bin/ringwatch
ENV_FILE=/etc/ringwatch/prolog.env

exec "$RINGWATCH" slurm prolog --env-file "$ENV_FILE"
