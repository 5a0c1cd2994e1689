#!/usr/bin/env bash
# plot.sh CSV [PNG]: grouped bar chart of calls/s from an idemrpc-bench CSV.
#
# One group per clients value, one bar per scenario; tcp rows of the first payload in
# the file, plus f (raw LMDB, no transport, 1 thread) in its clients=1 group. Log scale:
# the durable scenarios are orders of magnitude below the echo baseline.
#
#   build/bench/idemrpc-bench --csv /tmp/bench.csv && bash bench/plot.sh /tmp/bench.csv
#
# Needs gnuplot (Debian: apt-get install gnuplot-nox). PNG defaults to /tmp/bench.png.
set -euo pipefail

usage() {
    echo "usage: $0 CSV [PNG]   (PNG default /tmp/bench.png; needs gnuplot:" \
         "apt-get install gnuplot-nox)"
}
usage_error() { [ -z "$1" ] || echo "$0: $1" >&2; usage >&2; exit 2; }

# The tools' convention (tools/cli.h): --help exits 0, any other option exits 2.
for arg in "$@"; do
    case $arg in
    --help | -h) usage; exit 0 ;;
    -?*) usage_error "unknown option '$arg'" ;;
    esac
done
[ $# -ge 1 ] || usage_error ""
[ $# -le 2 ] || usage_error "unexpected argument '$3'"
csv=$1
png=${2:-/tmp/bench.png}
[ -r "$csv" ] || usage_error "cannot read $csv"
command -v gnuplot >/dev/null || usage_error "gnuplot not found"

data=$(mktemp /tmp/idemrpc-plot-XXXXXX)
trap 'rm -f "$data"' EXIT

# Pivot to: clients  <scenario 1> <scenario 2> ...   ("?" = not measured). Columns are
# found by their header names, groups and scenarios keep the order of the file.
payload=$(awk -F, '
    NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i; next }
    $col["transport"] == "tcp" { print $col["payload"]; exit }' "$csv")
[ -n "$payload" ] || { echo "$0: no tcp rows in $csv" >&2; exit 1; }

awk -F, -v payload="$payload" '
    NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i; next }
    $col["payload"] != payload { next }
    $col["transport"] != "tcp" && $col["transport"] != "-" { next }
    {
        s = $col["scenario"]; k = $col["clients"]
        if (!(s in seen_s)) { seen_s[s] = 1; scen[++ns] = s }
        if (!(k in seen_k)) { seen_k[k] = 1; kl[++nk] = k }
        v[s, k] = $col["calls_per_s"]
    }
    END {
        line = "clients"
        for (j = 1; j <= ns; j++) line = line " " scen[j]
        print line
        for (i = 1; i <= nk; i++) {
            line = kl[i]
            for (j = 1; j <= ns; j++) line = line " " (((scen[j], kl[i]) in v) ? v[scen[j], kl[i]] : "?")
            print line
        }
    }' "$csv" >"$data"

ncols=$(head -1 "$data" | wc -w)
# The y axis starts at the power of ten below the smallest bar.
ymin=$(awk 'NR > 1 { for (i = 2; i <= NF; i++) if ($i != "?" && $i > 0 && (m == "" || $i < m)) m = $i }
            END { print (m == "" ? 1 : 10 ^ int(log(m) / log(10))) }' "$data")
[ "$ncols" -ge 2 ] || { echo "$0: nothing to plot" >&2; exit 1; }

gnuplot <<EOF
set terminal pngcairo size 1100,600 noenhanced font ",11"
set output "$png"
set title "idemrpc-bench: calls/s, tcp, payload $payload B (f: raw LMDB, 1 thread)"
set datafile missing "?"
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.85 border -1
set boxwidth 0.9
set logscale y
set format y "%.0s%c"
set yrange [$ymin:*]
set grid ytics mytics
set ylabel "calls/s (log scale)"
set xlabel "clients"
set key outside right top
plot for [i=2:$ncols] "$data" using i:xtic(1) title columnheader(i)
EOF
echo "$png"
