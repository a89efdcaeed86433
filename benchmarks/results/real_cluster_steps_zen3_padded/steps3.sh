#!/bin/bash
# After 3 rows pad to 4: a fresh profile, then arrow and flowyard at conv-mixed's fixed rate.
set -x
cd /work/main
PY=.venv/bin/python
$PY -m flowyard.cli profile --quick --passes 3 --out /work/rc36/profile-pad34.json > /work/rc36/profile-pad34.log 2>&1
for name in arrow flowyard; do
  $PY benchmarks/real_cluster_steps.py --policy $name --workload conv-mixed --rates 0.241 --repeats 2 --slo-factor 4 --profile /work/rc36/profile-pad34.json --out /work/rc36/steps-$name-pad34.md > /work/rc36/steps-$name-pad34.log 2>&1
done
echo done > /work/rc36/steps3.done
