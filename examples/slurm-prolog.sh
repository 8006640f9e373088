#!/usr/bin/env bash
# Slurm prolog (or PrologSlurmctld) gate: refuse to start a job on nodes whose
# fabric ringwatch finds unhealthy.
#
#   Prolog=/etc/slurm/ringwatch-prolog.sh      in slurm.conf
#
# Needs RINGWATCH_API_URL and RINGWATCH_TOKEN (a reader token) in the prolog's
# environment. Exit 0 lets the job start; any other exit fails it and logs why.
# RINGWATCH_PREFLIGHT_MAX_AGE: reuse results younger than this many seconds (900).
# RINGWATCH_PREFLIGHT_TIMEOUT: how long to wait for fresh probes (300).
# RINGWATCH_FAIL_OPEN=1: let the job start when ringwatch itself cannot answer.
# RINGWATCH_PREFLIGHT_CONFIRM=1: re-probe suspects before refusing (needs a scheduler).
set -u

nodelist="${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}"
if [ -z "$nodelist" ]; then
    echo "ringwatch prolog: SLURM_JOB_NODELIST is not set" >&2
    exit 2
fi

# A compressed host list (node[001-004,007]) is expanded by scontrol where Slurm is
# installed, and by ringwatch itself otherwise (--nodes takes Slurm's syntax).
if command -v scontrol >/dev/null 2>&1; then
    nodes=$(scontrol show hostnames "$nodelist" | paste -sd, -)
else
    nodes="$nodelist"
fi

# The preflight's stderr goes to a private file (mktemp: unpredictable name, mode 0600),
# removed however the prolog ends; a prolog runs as root.
errfile=$(mktemp "${TMPDIR:-/tmp}/ringwatch-prolog.XXXXXXXX") || {
    echo "ringwatch prolog: cannot create a temporary file" >&2; exit 2; }
trap 'rm -f "$errfile"' EXIT

ringwatch="${RINGWATCH_BIN:-ringwatch}"
# --confirm: where fresh results look unhealthy, a scheduler re-probes (re-testing every
# suspect) before the job is refused; a healthy answer comes at once.
out=$("$ringwatch" preflight --nodes "$nodes" --json ${RINGWATCH_PREFLIGHT_CONFIRM:+--confirm} \
      --max-age "${RINGWATCH_PREFLIGHT_MAX_AGE:-900}" \
      --timeout "${RINGWATCH_PREFLIGHT_TIMEOUT:-300}" 2>"$errfile")
rc=$?
err=$(cat "$errfile" 2>/dev/null)

case $rc in
    0) exit 0 ;;
    1)
        exclude=$(printf '%s' "$out" | python3 -c 'import json,sys; print(",".join(json.load(sys.stdin)["exclude"]))' 2>/dev/null)
        echo "ringwatch prolog: fabric unhealthy for job ${SLURM_JOB_ID:-?}; exclude: ${exclude:-see verdict}" >&2
        printf '%s\n' "$out" >&2
        exit 1 ;;
    *)
        echo "ringwatch prolog: preflight could not answer: ${err:-exit $rc}" >&2
        [ "${RINGWATCH_FAIL_OPEN:-0}" = "1" ] && exit 0
        exit 2 ;;
esac
