#!/bin/bash
# The other five policies at conv-mixed's fixed rate, padded engine, the same profile.
set -x
cd /work/main
PY=.venv/bin/python
FLOWYARD_SKINNY_PAD=on $PY benchmarks/real_cluster_steps.py --policy dynaserve --workload conv-mixed --rates 0.258 --repeats 2 --slo-factor 4 --profile /work/rc36/profile-pad-on.json --out /work/rc36/steps-dynaserve-pad-on-again.md > /work/rc36/steps-dynaserve-on-again.log 2>&1
for name in flowyard vllm pla flowprefill arrow; do
  FLOWYARD_SKINNY_PAD=on $PY benchmarks/real_cluster_steps.py --policy $name --workload conv-mixed --rates 0.241 --repeats 2 --slo-factor 4 --profile /work/rc36/profile-pad-on.json --out /work/rc36/steps-$name-pad-on.md > /work/rc36/steps-$name-on.log 2>&1
done
echo done > /work/rc36/steps2.done
