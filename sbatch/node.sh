# sbatch/node.sh — the common tail of every engine job template (sourced, not run).
#
# The template sets MODEL, GPU, TP, OTELA_DIR, KEY_FILE, GRANT_FILE (may be empty), BOOTSTRAP, PYTHON,
# LISTEN_HOST and ENGINE_CMD (with "{port}" where the engine's port goes). This picks the ports, labels the
# session so the placer can count it, and execs otela_node.py: the batch shell becomes the
# node, so Slurm's `--signal=B:TERM@120` (and scancel's SIGTERM) reach it directly and it
# drains in-flight requests, marks its session LEFT and stops the engine before SIGKILL.
# Never daemonize here: a process that calls setsid() escapes Slurm's process tracking.

: "${OTELA_DIR:?}" "${KEY_FILE:?}" "${BOOTSTRAP:?}" "${MODEL:?}" "${ENGINE_CMD:?}"
JOB=${SLURM_JOB_ID:-$$}
# Port 0: the node binds free ports and advertises what it got, so any number of jobs share
# a node; the node also replaces "{port}" in the engine command by a free port. Set
# NODE_LISTEN / NODE_GOSSIP (HOST:PORT) where a firewall wants fixed ones.
NODE_LISTEN=${NODE_LISTEN:-${LISTEN_HOST:-0.0.0.0}:0}
NODE_GOSSIP=${NODE_GOSSIP:-${LISTEN_HOST:-0.0.0.0}:0}

PYTHON=${PYTHON:-python3}

# The job's interpreter first, in the shell: a compute node's python3 is often older than the
# login node's (RHEL/Rocky 8: 3.6, on which otela's first line is a SyntaxError) or lacks h11.
# `-V` answers on any Python, so each case is one line in the job's log, with the job id; exit
# 3 sets these apart from the node's own exits in `sacct`.
why_not() { echo "otela job $JOB: $PYTHON $1; set \"python\" in the site file (or --sbatch-var PYTHON=...)" >&2; exit 3; }
command -v "$PYTHON" >/dev/null || why_not "is not found on $(hostname)"
version=$("$PYTHON" -V 2>&1) || why_not "does not run (${version:-no answer to -V})"
if [[ ! $version =~ ^Python\ 3\.([0-9]+) ]] || (( BASH_REMATCH[1] < 9 )); then
  why_not "is ${version:-no Python}; otela needs Python 3.9 or newer"
fi
"$PYTHON" -c 'import h11' 2>/dev/null || why_not "($version) cannot import h11: put its wheel on PYTHONPATH"

# The job's end, which the node publishes (ends_at: the ingress sends nothing new in the job's last
# minutes, the placer starts its successor ahead): Slurm 23.02 and later say it; before, squeue does.
if [[ -z ${SLURM_JOB_END_TIME:-} && -n ${SLURM_JOB_ID:-} ]]; then
  end=$(squeue -h -j "$SLURM_JOB_ID" -o %e 2>/dev/null || true)
  if [[ $end == [0-9]*T* ]] && end=$(date -d "$end" +%s 2>/dev/null); then
    export SLURM_JOB_END_TIME=$end
  fi
fi

# A model bigger than a node (sbatch/ranks.sh) is counted by the placer as (model, gpu, tp, pp).
layout=()
if (( ${PP:-1} > 1 )); then layout=(--label "otela.pp=$PP"); fi
echo "otela job $JOB: $MODEL on ${GPU:-?} tp=${TP:-1}${OTELA_INSTANCE_NODES:+ pp=$PP on $OTELA_INSTANCE_NODES, rank 0} on $(hostname), $version"
exec "$PYTHON" "$OTELA_DIR/otela_node.py" start \
  --key-file "$KEY_FILE" \
  ${GRANT_FILE:+--grant-file "$GRANT_FILE"} \
  --bootstrap "$BOOTSTRAP" \
  --process "$ENGINE_CMD" \
  --listen "$NODE_LISTEN" \
  --gossip "$NODE_GOSSIP" \
  --label "slurm_job=$JOB" \
  --label "otela.model=$MODEL" \
  --label "otela.gpu=${GPU:-}" \
  --label "otela.tp=${TP:-1}" \
  ${layout[@]+"${layout[@]}"}
