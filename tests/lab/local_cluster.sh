#!/usr/bin/env bash
# local_cluster.sh — what `make run` runs: a whole otela cluster on loopback.
#   one ingress (OpenAI API on $OTELA_RUN_PORT, default 8080) and two nodes, each wrapping a
#   real tiny engine (llama.cpp's server from the xllamacpp wheel + SmolLM2-135M), a demo key, then a curl to try.
# Ctrl-C stops everything: nodes drain and leave, engines stop, the ingress leaves; the script
# then exits 0 (a clean stop is no error for make).
# State lives in ${OTELA_RUN_DIR:-.cache/run}, in two folders as on a cluster: cluster/ (the
# cluster key and the tunnel's certificate: what every job reads) and ingress/ (mode 0700:
# ingress.key and the usage ledger, which hold the authority over keys and usage and which no
# job may read); the demo key and the logs beside them. The demo key is made once and reused
# while it is active in that ledger.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
PORT=${OTELA_RUN_PORT:-8080}
GOSSIP=${OTELA_RUN_GOSSIP:-7946}
D=${OTELA_RUN_DIR:-.cache/run}
ENGINE_PY=.cache/engine/venv/bin/python
MODEL=.cache/engine/SmolLM2-135M-Instruct.Q4_1.gguf
[ -x "$ENGINE_PY" ] && [ -s "$MODEL" ] || { echo "run: the engine is missing: make engine" >&2; exit 1; }
for p in "$PORT" $((PORT + 1)) $((PORT + 2)); do
  if (exec 3<>/dev/tcp/127.0.0.1/$p) 2>/dev/null; then
    echo "run: port $p is in use; set OTELA_RUN_PORT to another base port" >&2; exit 1
  fi
done
mkdir -p "$D"
pids=()
stop() {
  trap - INT TERM EXIT
  echo; echo "run: stopping (nodes drain, engines stop, sessions leave)"
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  echo "run: stopped"
}
trap 'stop; exit 0' INT TERM
trap stop EXIT

mkdir -p -m 700 "$D/ingress"
[ -s "$D/cluster/cluster.key" ] || "$PY" otela_node.py keygen --out "$D/cluster" >/dev/null
if [ -e "$D/cluster/ingress.key" ]; then   # keygen writes it beside the cluster key: not its place
  mv "$D/cluster/ingress.key" "$D/ingress/ingress.key"
fi
export OTELA_KEY_FILE=$D/cluster/cluster.key OTELA_INGRESS_KEY_FILE=$D/ingress/ingress.key \
  OTELA_DB=$D/ingress/usage.sqlite
"$PY" otela_ingress.py serve --listen "127.0.0.1:$PORT" --gossip "127.0.0.1:$GOSSIP" \
  > "$D/ingress.log" 2>&1 &
pids+=($!)
engine="$ENGINE_PY tests/lab/engine_serve.py -m $MODEL --alias smollm2-135m --host 127.0.0.1 --port {port}"
for i in 1 2; do
  # each job's grant, as the login node gives it: the model it may serve and its labels
  "$PY" otela_ingress.py grant --model smollm2-135m --label "node=demo$i" --job "node$i" --until 24h --out "$D/node$i.grant" 2>>"$D/grants.log"
  "$PY" otela_node.py start --grant-file "$D/node$i.grant" --bootstrap "127.0.0.1:$GOSSIP" --listen "127.0.0.1:$((PORT + i))" \
    --gossip "127.0.0.1:$((GOSSIP + i))" --label "node=demo$i" --process "$engine" \
    > "$D/node$i.log" 2>&1 &
  pids+=($!)
done
# The demo key: the one saved by an earlier run while it is still active, else a new one.
KEY=""
if [ -s "$D/demo.key" ]; then
  read -r KEY_ID KEY < "$D/demo.key" || true
  "$PY" otela_ingress.py keys list --json | "$PY" -c 'import json, sys, time
keys = [k for k in json.load(sys.stdin) if k["id"] == sys.argv[1]]
sys.exit(0 if keys and not keys[0]["revoked"] and (keys[0]["expires"] or 1e300) > time.time() else 1)' "$KEY_ID" \
    || KEY=""
fi
if [ -z "$KEY" ]; then
  made=$("$PY" otela_ingress.py keys create --user demo --json)
  read -r KEY_ID KEY <<<"$("$PY" -c 'import json,sys; k = json.load(sys.stdin); print(k["id"], k["key"])' <<<"$made")"
  (umask 077; echo "$KEY_ID $KEY" > "$D/demo.key")
fi

echo "run: waiting for both engines to load and join (logs in $D)"
for _ in $(seq 600); do
  n=$(curl -s "http://127.0.0.1:$PORT/v1/registry" | "$PY" -c \
    'import json,sys; print(sum(s["state"]=="SERVING" and not s["suspected"] and "smollm2-135m" in s.get("models",[]) for s in json.load(sys.stdin)["sessions"]))' 2>/dev/null || echo 0)
  [ "$n" = 2 ] && break
  for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null || { echo "run: a process died; see $D/*.log" >&2; exit 1; }; done
  sleep 0.5
done
[ "$n" = 2 ] || { echo "run: nodes did not come up in 5 min; see $D/*.log" >&2; exit 1; }
cat <<MSG

otela is up: ingress http://127.0.0.1:$PORT, two nodes serving smollm2-135m.
  registry   curl -s http://127.0.0.1:$PORT/v1/registry
  dashboard  http://127.0.0.1:$PORT/dashboard
Try it:

curl -s http://127.0.0.1:$PORT/v1/chat/completions -H "Authorization: Bearer $KEY" \\
  -H 'Content-Type: application/json' \\
  -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 32}'

.venv/bin/python - <<'PY'
from openai import OpenAI
client = OpenAI(base_url="http://127.0.0.1:$PORT/v1", api_key="$KEY")
for chunk in client.chat.completions.create(model="smollm2-135m", stream=True, max_tokens=32,
        messages=[{"role": "user", "content": "Say hello"}]):
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
PY

Ctrl-C stops everything.
MSG
wait "${pids[0]}"
