#!/usr/bin/env bash
# Headless locust run against a jobtier API, with CSV and HTML reports saved per run.
#
#   loadtest/run.sh                                   # the mix: 50 users, 10/s spawn, 30 s
#   loadtest/run.sh -s poller -u 200 -r 50 -t 60s     # status reads only
#   loadtest/run.sh --dev-keys .data/dev-keys.json    # the key of a `jobtier run` instance
#   loadtest/run.sh -- --stop-timeout 5               # anything after -- goes to locust
#
# Reports land in loadtest/results/<UTC timestamp>/ (git-ignored): stats_stats.csv (one row
# per request name, with percentiles), stats_stats_history.csv, stats_failures.csv,
# stats_exceptions.csv, report.html, and run.txt (the parameters and the commit). The
# locustfile's docstring lists the LOADTEST_* variables (job mix, idempotency, SSE, weights).
# Only loopback targets are loaded unless LOADTEST_ALLOW_REMOTE=1.
#
# Distributed runs. One locust process uses one core; at a few thousand requests/s it, not
# the server, is the limit (watch its CPU: locust warns above 90%). On one machine,
# `-p N` (locust --processes N) forks N worker processes under a master. Across machines,
# start one master and N workers with the same locustfile and environment:
#
#   master$  locust -f loadtest/locustfile.py --master --headless --expect-workers 4 \
#                   -u 2000 -r 200 -t 5m --host http://api.internal:8000 \
#                   --csv results/stats --html results/report.html
#   each worker host$  JOBTIER_KEY=... LOADTEST_ALLOW_REMOTE=1 \
#                   locust -f loadtest/locustfile.py --worker --master-host <master address>
#
# (and LOADTEST_ALLOW_REMOTE=1 on the master too when the API is not on loopback). The master
# waits for --expect-workers, splits the users between them, and merges their stats into one
# report. Every worker submits its own job set for the pollers at test start; give them all
# the same LOADTEST_JOBS_FILE to share one hot set.
#
# Closed loop, and what it hides. Each locust user sends its next request only after the
# previous answer arrived. When the server stalls (a GC pause, a slow Redis call), the users
# stall with it and send nothing, so the stall shows up in a handful of samples instead of in
# every request that a real population of clients would have sent meanwhile: the tail
# percentiles come out far too good ("coordinated omission"), and the request rate falls
# exactly when latency is bad. Use this harness for mixed, realistic traffic (ETags, SSE,
# idempotent submits) and for finding errors under load; take latency percentiles at a given
# rate from the open-loop benchmark, bench/status_read.py, which schedules requests at a
# fixed rate and measures from each request's intended send time (bench/results/).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"

users=50
spawn_rate=10
run_time=30s
scenario=mixed
processes=1
url="${JOBTIER_URL:-http://127.0.0.1:8000}"
key="${JOBTIER_KEY:-}"
out=""

usage() {
    cat <<EOF
usage: loadtest/run.sh [options] [-- locust options]

Run locust headless against a jobtier API; CSV and HTML reports go to
loadtest/results/<timestamp>/ (or --out).

  -u, --users N         simulated users (default $users)
  -r, --spawn-rate N    users started per second (default $spawn_rate)
  -t, --run-time T      duration, e.g. 30s, 5m (default $run_time)
  -s, --scenario S      mixed | poller | submitter | watcher (default $scenario)
      --url URL         the API (default \$JOBTIER_URL or http://127.0.0.1:8000)
      --key KEY         a tenant API key (default \$JOBTIER_KEY)
      --dev-keys FILE   take the key from a \`jobtier run\` dev-keys.json
  -p, --processes N     locust worker processes on this machine (default 1: no master)
  -o, --out DIR         report folder (default loadtest/results/<timestamp>)
  -h, --help            this text

The job mix, idempotency, SSE and class weights are set by LOADTEST_* variables
(see loadtest/locustfile.py). Only loopback URLs unless LOADTEST_ALLOW_REMOTE=1.
EOF
}

die() {
    echo "run.sh: $*" >&2
    exit 2
}

need_value() {
    [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value (see --help)"
}

extra=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        -u | --users) need_value "$@"; users="$2"; shift 2 ;;
        -r | --spawn-rate) need_value "$@"; spawn_rate="$2"; shift 2 ;;
        -t | --run-time) need_value "$@"; run_time="$2"; shift 2 ;;
        -s | --scenario) need_value "$@"; scenario="$2"; shift 2 ;;
        --url) need_value "$@"; url="$2"; shift 2 ;;
        --key) need_value "$@"; key="$2"; shift 2 ;;
        --dev-keys)
            need_value "$@"
            [[ -r "$2" ]] || die "cannot read $2"
            key="$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["tenant_key"])' "$2")"
            shift 2
            ;;
        -p | --processes) need_value "$@"; processes="$2"; shift 2 ;;
        -o | --out) need_value "$@"; out="$2"; shift 2 ;;
        -h | --help) usage; exit 0 ;;
        --) shift; extra=("$@"); break ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done

[[ "$users" =~ ^[1-9][0-9]*$ ]] || die "--users must be a positive integer"
[[ "$spawn_rate" =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "--spawn-rate must be a number"
[[ "$run_time" =~ ^([0-9]+[hms])+$ ]] || die "--run-time must look like 30s, 5m or 1h30m"
[[ "$processes" =~ ^[1-9][0-9]*$ ]] || die "--processes must be a positive integer"
[[ -n "$key" ]] || die "no API key: pass --key, --dev-keys FILE, or set JOBTIER_KEY"

case "$scenario" in
    mixed) classes=(Poller Submitter Watcher) ;;
    poller) classes=(Poller) ;;
    submitter) classes=(Submitter) ;;
    watcher) classes=(Watcher) ;;
    *) die "unknown scenario $scenario: mixed, poller, submitter or watcher" ;;
esac

locust="${LOCUST:-}"
if [[ -z "$locust" ]]; then
    if [[ -x "$repo/.venv/bin/locust" ]]; then
        locust="$repo/.venv/bin/locust"
    else
        locust="$(command -v locust)" || die "locust not found: pip install -e '.[dev]'"
    fi
fi

if [[ -z "$out" ]]; then
    out="$here/results/$(date -u +%Y%m%dT%H%M%SZ)"
fi
mkdir -p "$out"

distributed=()
if [[ "$processes" -gt 1 ]]; then
    distributed=(--processes "$processes")
fi

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "url: $url"
    echo "scenario: $scenario (${classes[*]})"
    echo "users: $users  spawn rate: $spawn_rate/s  run time: $run_time  processes: $processes"
    env | grep -E '^LOADTEST_' | sort || true
} >"$out/run.txt"

echo "run.sh: $scenario, $users users, $run_time against $url; reports in $out" >&2
status=0
JOBTIER_URL="$url" JOBTIER_KEY="$key" "$locust" \
    -f "$here/locustfile.py" \
    --headless --only-summary \
    --host "$url" \
    -u "$users" -r "$spawn_rate" -t "$run_time" \
    --csv "$out/stats" --html "$out/report.html" \
    ${distributed[@]+"${distributed[@]}"} \
    ${extra[@]+"${extra[@]}"} \
    "${classes[@]}" || status=$?

echo "run.sh: reports in $out (exit $status)" >&2
exit "$status"
