#!/bin/bash
# Issue 7's workload in process (bench.engine_offline), main 18c48dd and seams2 alternating, 3 runs each.
out=/tmp/seams2_ab.jsonl; : > $out
for i in 1 2 3; do
  for tree in /work/wt/seams2-base /work/wt/seams2; do
    cd $tree
    r=$(PYTHONPATH=$tree TORCH_EXTENSIONS_DIR=/tmp/torch_ext_seams2_$(basename $tree) .venv/bin/python -m bench.engine_offline --dtype float32 --num-requests 64 --concurrency 32 --max-tokens 64 --json 2>/dev/null | tail -1)
    echo "{\"tree\": \"$(basename $tree)\", \"rev\": \"$(git rev-parse --short HEAD)\", \"run\": $i, \"result\": $r}" >> $out
  done
done
echo done >> $out
