#!/bin/bash
# login-node.sh — keep an otela ingress running on a login node, and run the
# placer, without root and without systemd. Cron-friendly: `start` does nothing when the
# process in the pid file is alive, so a crontab line restarts it after a reboot or a crash:
#
#   */5 * * * *  $HOME/otela/sbatch/login-node.sh ingress start
#   */5 * * * *  $HOME/otela/sbatch/login-node.sh place          # plan + reconcile Slurm jobs
#   */5 * * * *  $HOME/otela/sbatch/login-node.sh relay start    # a relay for nodes behind NATs
#
# Where user crontabs are forbidden, Slurm's scrontab runs the placer instead, as a small job
# every 5 minutes: `login-node.sh scrontab > otela.scron` prints its lines (they name this login
# node's ingress and gossip port, since the job runs elsewhere), `scrontab otela.scron` installs
# them (it replaces your scrontab: add what `scrontab -l` shows first). The ingress stays a
# login-node process (the crontab line above, or however the site allows one).
#
# `place` keeps its reclamation state (demand history, cooldowns) in $OTELA_STATE/place-state.json,
# next to its lock; add --no-reclaim to reconcile to each plan at once. It reads the site file
# $OTELA_STATE/site.json when there (or OTELA_SITE), and the jobs run this script's PYTHON
# unless the site file names theirs.
#
# Usage: login-node.sh ingress start|stop|status
#        login-node.sh relay start|stop|status
#        login-node.sh place [extra otela_place.py plan flags]
#        login-node.sh scrontab
# Environment (defaults in brackets):
#   OTELA_DIR    the otela checkout [this script's parent]
#   OTELA_STATE  cluster key, pid files and logs [~/.otela]
#   OTELA_INGRESS_STATE the ingress's secret (ingress.key) and database, on this login node's own
#                disk, never the shared home that compute jobs read [/var/tmp/otela-$USER]
#   OTELA_LISTEN ingress HTTP address [0.0.0.0:8080]   OTELA_GOSSIP gossip address [0.0.0.0:7946]
#   OTELA_BOOTSTRAP other ingresses to join [none: a new overlay]
#   OTELA_RELAY_GOSSIP the relay's gossip address [0.0.0.0:7946, or 0.0.0.0:7947 beside an ingress]
#   OTELA_RELAY_LISTEN the relay's /healthz address [127.0.0.1:7701]
#   PYTHON       interpreter [the checkout's .venv/bin/python when there (make venv), else python3,
#                which then needs h11 installed or on PYTHONPATH: see the README, without pip]
#   OTELA_FROM_INGRESS the ingress `place` reads [http://127.0.0.1:<OTELA_LISTEN's port>]
#   OTELA_NODE_BOOTSTRAP where the jobs' nodes join [this host's name:<OTELA_GOSSIP's port>]
#   OTELA_SCRON_ARGS #SCRON options of the placer's job (e.g. --partition=service --account=proj)
set -euo pipefail

OTELA_DIR=${OTELA_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
STATE=${OTELA_STATE:-$HOME/.otela}
if [[ -z ${PYTHON:-} ]]; then
  PYTHON=python3
  [[ -x $OTELA_DIR/.venv/bin/python ]] && PYTHON=$OTELA_DIR/.venv/bin/python
fi
LISTEN=${OTELA_LISTEN:-0.0.0.0:8080}
GOSSIP=${OTELA_GOSSIP:-0.0.0.0:7946}
role=${1:-}
action=${2:-start}
usage="usage: $0 ingress|relay start|stop|status | place [plan flags] | scrontab"
case $role in ingress|relay|place|scrontab) ;; *) echo "$usage" >&2; exit 2 ;; esac
mkdir -p "$STATE/logs"
# (to stderr: `scrontab` prints a file on stdout)
[[ -f $STATE/cluster.key ]] || "$PYTHON" "$OTELA_DIR/otela_node.py" keygen --out "$STATE" >&2

alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

case $role in
  ingress)
    # The ingress tier's secret and the key database stay off the shared home (a job runs as this
    # user and could otherwise mint keys): keygen wrote ingress.key into $STATE; move it here.
    LOCAL=${OTELA_INGRESS_STATE:-/var/tmp/otela-${USER:-$(id -un)}}
    mkdir -p -m 700 "$LOCAL"
    if [[ ! -f $LOCAL/ingress.key ]]; then
      if [[ -f $STATE/ingress.key ]]; then mv "$STATE/ingress.key" "$LOCAL/ingress.key"
      else "$PYTHON" "$OTELA_DIR/otela_node.py" keygen --ingress-only --out "$LOCAL" >/dev/null; fi
    fi
    DB=$LOCAL/usage.sqlite
    [[ -f $STATE/usage.sqlite && ! -f $DB ]] && DB=$STATE/usage.sqlite   # an existing deployment's
    cmd=("$PYTHON" "$OTELA_DIR/otela_ingress.py" serve --key-file "$STATE/cluster.key"
         --listen "$LISTEN" --gossip "$GOSSIP" --db "$DB" --ingress-key-file "$LOCAL/ingress.key")
    # the site's catalogue: a model it offers that nothing serves yet is 503 "starting", and demand
    [[ -z ${OTELA_SITE:-} && -f $STATE/site.json ]] && cmd+=(--site "$STATE/site.json")
    ;;
  relay)
    # the ingress relays too; a relay of its own on another port keeps private nodes reachable
    # while the ingress restarts (they hold links to two relays)
    relay_gossip=${OTELA_RELAY_GOSSIP:-}
    if [[ -z $relay_gossip ]]; then
      relay_gossip=0.0.0.0:7946
      alive "$STATE/ingress.pid" && relay_gossip=0.0.0.0:7947
    fi
    cmd=("$PYTHON" "$OTELA_DIR/otela_node.py" relay --key-file "$STATE/cluster.key"
         --gossip "$relay_gossip" --listen "${OTELA_RELAY_LISTEN:-127.0.0.1:7701}")
    [[ -z ${OTELA_BOOTSTRAP:-} ]] && alive "$STATE/ingress.pid" && cmd+=(--bootstrap "127.0.0.1:${GOSSIP##*:}")
    ;;
  place)
    shift || true
    # --lock keeps two cron runs apart; the ingress gives demand and live sessions; the jobs'
    # logs go where the site file says, else beside this script's
    site=()
    if [[ -z ${OTELA_SITE:-} && -f $STATE/site.json ]]; then site=(--site "$STATE/site.json")
    elif [[ -z ${OTELA_SITE:-} ]]; then site=(--sbatch-var "LOG_DIR=$STATE/logs"); fi
    # each job's grant is signed by the ingress secret, on this host's own disk (see ingress)
    export OTELA_INGRESS_KEY_FILE=${OTELA_INGRESS_KEY_FILE:-${OTELA_INGRESS_STATE:-/var/tmp/otela-${USER:-$(id -un)}}/ingress.key}
    exec "$PYTHON" "$OTELA_DIR/otela_place.py" plan \
      --from-ingress "${OTELA_FROM_INGRESS:-http://127.0.0.1:${LISTEN##*:}}" ${site[@]+"${site[@]}"} \
      --from-slurm --emit-sbatch "$STATE/jobs" --submit --lock "$STATE/place.lock" \
      --sbatch-var "KEY_FILE=$STATE/cluster.key" \
      --sbatch-var "BOOTSTRAP=${OTELA_NODE_BOOTSTRAP:-$(hostname -f):${GOSSIP##*:}}" "$@"
    ;;
  scrontab)
    host=$(hostname -f)
    echo "#SCRON --job-name=otela-place --time=00:10:00${OTELA_SCRON_ARGS:+ $OTELA_SCRON_ARGS}"
    printf '*/5 * * * * env'
    printf ' %q' "OTELA_STATE=$STATE" "PYTHON=$PYTHON" "OTELA_FROM_INGRESS=http://$host:${LISTEN##*:}" \
      "OTELA_NODE_BOOTSTRAP=$host:${GOSSIP##*:}" "$OTELA_DIR/sbatch/login-node.sh" place
    echo
    exit 0
    ;;
esac
[[ -n ${OTELA_BOOTSTRAP:-} ]] && cmd+=(--bootstrap "$OTELA_BOOTSTRAP")

pidfile=$STATE/$role.pid
case $action in
  start)
    alive "$pidfile" && exit 0
    # nohup + setsid is right here (a login-node service), never inside a Slurm job
    nohup setsid "${cmd[@]}" >>"$STATE/logs/$role.log" 2>&1 < /dev/null &
    echo $! > "$pidfile"
    echo "$role started (pid $!), log $STATE/logs/$role.log"
    ;;
  stop)
    if alive "$pidfile"; then kill -TERM "$(cat "$pidfile")"; echo "$role stopping"; fi
    rm -f "$pidfile"
    ;;
  status)
    if alive "$pidfile"; then echo "$role running (pid $(cat "$pidfile"))"; else echo "$role stopped"; exit 1; fi
    ;;
  *) echo "usage: $0 $role start|stop|status" >&2; exit 2 ;;
esac
