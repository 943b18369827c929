# sbatch/node.sh — the common tail of every engine job template (sourced, not run).
#
# The template sets MODEL, GPU, TP, OTELA_DIR, KEY_FILE, BOOTSTRAP, PYTHON, LISTEN_HOST and
# ENGINE_CMD (with "{port}" where the engine's port goes). This picks the ports, labels the
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

echo "otela job $JOB: $MODEL on ${GPU:-?} tp=${TP:-1} on $(hostname)"
exec "${PYTHON:-python3}" "$OTELA_DIR/otela_node.py" start \
  --key-file "$KEY_FILE" \
  --bootstrap "$BOOTSTRAP" \
  --process "$ENGINE_CMD" \
  --listen "$NODE_LISTEN" \
  --gossip "$NODE_GOSSIP" \
  --label "slurm_job=$JOB" \
  --label "otela.model=$MODEL" \
  --label "otela.gpu=${GPU:-}" \
  --label "otela.tp=${TP:-1}"
