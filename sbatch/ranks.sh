# sbatch/ranks.sh — the other nodes of a model bigger than a node (sourced by the engine
# templates, not run). With NODES > 1 the job holds NODES whole nodes: this batch shell, on the
# first, becomes the node (node.sh) wrapping rank 0, which alone serves HTTP; `start_ranks`
# runs the rest through one `srun` step, one task per other node, started with the job and
# stopped with it:
#   - a rank that dies ends the step (--kill-on-bad-exit), and the end of the step, for any
#     reason, sends SIGTERM to the node: its session is DOWN at once, in-flight requests drain,
#     the job ends and the placer's next pass replaces it (a pipeline missing a stage serves
#     nothing; an engine's own NCCL or Ray timeout would take minutes to say so);
#   - Slurm's --signal before the time limit reaches the node (the batch shell): it drains rank
#     0 and leaves; the job's end then stops the step, and with it every other rank.
# Never daemonized (setsid escapes Slurm's process tracking); srun is the node's child.

NODES=${NODES:-1}
PP=${PP:-1}
# What the node publishes in its session's hardware (otela_node.py, instance_layout): the
# instance's host names, tp and pp; the registry and the dashboard show them.
if (( NODES > 1 )); then
  OTELA_INSTANCE_NODES=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-$(hostname)}" 2>/dev/null | paste -sd, -)
  export OTELA_INSTANCE_NODES OTELA_INSTANCE_TP=$TP OTELA_INSTANCE_PP=$PP
  # rank 0's address as the other nodes reach it, and a port for the engine's rendezvous
  # (fixed per job: the other ranks are started before rank 0 is)
  HEAD_ADDR=$(hostname --ip-address 2>/dev/null | awk '{print $1}')
  HEAD_ADDR=${HEAD_ADDR:-$(hostname)}
  DIST_PORT=$(( 20000 + ${SLURM_JOB_ID:-$$} % 20000 ))
fi

# start_ranks COMMAND: COMMAND on every other node of the job, with RANK set to 1, 2, … in its
# environment (the engine's node rank).
start_ranks() {
  local node_pid=$$
  (
    set +e   # (the template's set -e would end this shell with a failed step, before it stops the node)
    srun --nodes=$((NODES - 1)) --ntasks=$((NODES - 1)) --ntasks-per-node=1 --exclude="${SLURMD_NODENAME:-$(hostname)}" \
      --kill-on-bad-exit=1 bash -c "RANK=\$((SLURM_PROCID + 1)); export RANK; exec $1"
    echo "otela job ${SLURM_JOB_ID:-}: the other ranks ended (code $?); stopping the node" >&2
    kill -TERM "$node_pid" 2>/dev/null
  ) &
}
