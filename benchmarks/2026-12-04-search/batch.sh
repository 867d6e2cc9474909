#!/bin/bash
# one lock for a batch of runs: the before and after runs of a case back to back
cd /work/wt/search2/benchmarks/2026-12-04-search
export REV=88cb313 LIMIT=600 LOCKED=1
CASES="gpt96-48gb" FIRST=2 bash run.sh after 1
CASES="gpt96-48gb" FIRST=2 bash run.sh before 1
CASES="paper-h3072-l24 paper-h4096-l16 paper-h6144-l16 paper-h8192-l8 paper-h12288-l4" bash run.sh before 1
CASES="paper-h1024-l24 paper-h2048-l24 paper-h3072-l24 paper-h4096-l16 paper-h6144-l16 paper-h8192-l8 paper-h12288-l4" bash run.sh after 1
CASES="gpt96-48gb" FIRST=3 bash run.sh after 1
CASES="gpt96-48gb" FIRST=3 bash run.sh before 1
echo "batch done $(date)"
