#!/usr/bin/env bash
# Reproduces this report: synthetic corpora of 10 MB, 100 MB, 1 GB and 5 GB of text made from
# this machine's Python standard library sources (under $DATA_BENCH, default /work/data-bench:
# about 16 GB of disk with the prepared shards), then, each under the machine's CPU lock:
# prepare throughput against the tokenizers library's one encode_batch call; per corpus the
# data's open time, `oases train`'s time to the first step and every rank's resident memory
# (prepared folder, and the in-memory path of the commit before this work up to 1 GB); and
# `oases train` on configs/default.toml before and after. About 25 minutes on 2 idle cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=benchmarks/2026-12-03-data
root=${DATA_BENCH:-/work/data-bench}
py=${PY:-.venv/bin/python}
base=$root/base-src  # the commit before this work, for the "before" rows
if [ ! -d "$base/src" ]; then
    mkdir -p "$base" && git archive 99886f7 src configs | tar -x -C "$base"
fi
rm -f $out/results.json
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
$py $out/bench.py corpora "$root"
flock /tmp/oases-cpu.lock $py $out/bench.py throughput "$root" $out
flock /tmp/oases-cpu.lock $py $out/bench.py startup "$root" $out "$base/src"
flock /tmp/oases-cpu.lock $py $out/bench.py train $out "$base/src" "$root"
flock /tmp/oases-cpu.lock $py $out/bench.py bpe-sample "$root" $out
$py $out/tables.py $out/results.json > $out/results.md
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
