#!/usr/bin/env bash
# sim_fleet.sh — what `make fleet` runs: an emulated GPU fleet on loopback, no GPU needed.
#   one ingress (OpenAI API on $OTELA_RUN_PORT, default 8080) and $FLEET_N nodes (default 8),
#   each wrapping `otela_sim.py serve` (an engine timed by the roofline: $FLEET_MODEL on
#   $FLEET_TP x $FLEET_GPU, default meta-llama/Llama-3.1-8B-Instruct on one H100), a demo key,
#   then a curl and a workload to try.
# Ctrl-C stops everything. State (cluster key, ledger, key, logs) in ${OTELA_RUN_DIR:-.cache/fleet}.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
PORT=${OTELA_RUN_PORT:-8080}
GOSSIP=${OTELA_RUN_GOSSIP:-7946}
D=${OTELA_RUN_DIR:-.cache/fleet}
N=${FLEET_N:-8}
MODEL=${FLEET_MODEL:-meta-llama/Llama-3.1-8B-Instruct}
GPU=${FLEET_GPU:-H100}
TP=${FLEET_TP:-1}
"$PY" otela_sim.py estimate --model "$MODEL" --gpu "$GPU" --tp "$TP" --engine vllm-v1 >/dev/null || exit 1
for p in $(seq "$PORT" $((PORT + N))); do
  if (exec 3<>/dev/tcp/127.0.0.1/$p) 2>/dev/null; then
    echo "fleet: port $p is in use; set OTELA_RUN_PORT to another base port" >&2; exit 1
  fi
done
mkdir -p "$D"
pids=()
stop() {
  trap - INT TERM EXIT
  echo; echo "fleet: stopping (nodes drain, engines stop, sessions leave)"
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  echo "fleet: stopped"
}
trap 'stop; exit 0' INT TERM
trap stop EXIT

[ -s "$D/cluster.key" ] || "$PY" otela_node.py keygen --out "$D" >/dev/null
export OTELA_KEY_FILE=$D/cluster.key OTELA_DB=$D/usage.sqlite
"$PY" otela_ingress.py serve --listen "127.0.0.1:$PORT" --gossip "127.0.0.1:$GOSSIP" > "$D/ingress.log" 2>&1 &
pids+=($!)
engine="$PY otela_sim.py serve --model $MODEL --gpu $GPU --tp $TP --engine vllm-v1 --port {port}"
for i in $(seq "$N"); do
  # each job's grant, as the login node gives it: the model it may serve and its labels
  "$PY" otela_ingress.py grant --model "$MODEL" --label "node=sim$i" --label "gpu=$GPU" --job "node$i" --until 24h --out "$D/node$i.grant" 2>>"$D/grants.log"
  "$PY" otela_node.py start --grant-file "$D/node$i.grant" --bootstrap "127.0.0.1:$GOSSIP" --listen "127.0.0.1:$((PORT + i))" \
    --gossip "127.0.0.1:$((GOSSIP + i))" --label "node=sim$i" --label "gpu=$GPU" --process "$engine" \
    > "$D/node$i.log" 2>&1 &
  pids+=($!)
done
KEY=$("$PY" otela_ingress.py keys create --user fleet 2>/dev/null)
echo "fleet: waiting for $N emulated engines to join (logs in $D)"
n=0
for _ in $(seq 240); do
  n=$(curl -s "http://127.0.0.1:$PORT/v1/registry" | "$PY" -c \
    'import json,sys; print(sum(s["state"]=="SERVING" and not s["suspected"] and sys.argv[1] in s.get("models",[]) for s in json.load(sys.stdin)["sessions"]))' "$MODEL" 2>/dev/null || echo 0)
  [ "$n" = "$N" ] && break
  for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null || { echo "fleet: a process died; see $D/*.log" >&2; exit 1; }; done
  sleep 0.5
done
[ "$n" = "$N" ] || { echo "fleet: only $n of $N engines joined in 2 min; see $D/*.log" >&2; exit 1; }
cat <<MSG

otela fleet is up: ingress http://127.0.0.1:$PORT, $N emulated engines serving $MODEL ($TP x $GPU each).
  registry   curl -s http://127.0.0.1:$PORT/v1/registry
  dashboard  http://127.0.0.1:$PORT/dashboard
Try it:

curl -s http://127.0.0.1:$PORT/v1/chat/completions -H "Authorization: Bearer $KEY" \\
  -H 'Content-Type: application/json' \\
  -d '{"model": "$MODEL", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 32}'

A shared-prefix workload (presets: reasoning ~90 % reusable prefix, instruct ~15 %, chat):
$PY tests/workload.py --url http://127.0.0.1:$PORT --model $MODEL --key $KEY --preset reasoning --rate 20 --count 200

Ctrl-C stops everything.
MSG
wait "${pids[0]}"
