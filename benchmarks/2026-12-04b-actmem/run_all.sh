#!/bin/sh
# The measurements of this report, each multi-rank run under the CPU lock (one at a time).
cd "$(dirname "$0")/../.." || exit 1
PY=/work/main/.venv/bin/python
L="flock /tmp/oases-cpu.lock env PYTHONPATH=src:tests"
$L $PY benchmarks/2026-12-04b-actmem/peak_where.py issue > benchmarks/2026-12-04b-actmem/where-issue.txt 2>&1
$L $PY benchmarks/2026-12-04b-actmem/table.py 2 > /dev/null 2>&1
$L $PY benchmarks/2026-12-04b-actmem/table.py 4 > /dev/null 2>&1
$L $PY benchmarks/2026-12-04b-actmem/table.py 2 6 2048 > /dev/null 2>&1
PYTHONPATH=src $PY benchmarks/2026-12-04b-actmem/render.py > /dev/null
