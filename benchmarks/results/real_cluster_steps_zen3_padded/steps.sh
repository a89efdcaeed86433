#!/bin/bash
# Same-day before/after: engine small-GEMM padding off vs on, each with its own quick profile.
set -x
cd /work/main
PY=.venv/bin/python
for setting in on off; do
  FLOWYARD_SKINNY_PAD=$setting $PY -m flowyard.cli profile --quick --passes 3 --out /work/rc36/profile-pad-$setting.json > /work/rc36/profile-$setting.log 2>&1
done
for pol in dynaserve:0.258 distserve:0.266; do
  name=${pol%%:*}; rate=${pol##*:}
  for setting in on off; do
    FLOWYARD_SKINNY_PAD=$setting $PY benchmarks/real_cluster_steps.py --policy $name --workload conv-mixed --rates $rate --repeats 2 --slo-factor 4 --profile /work/rc36/profile-pad-$setting.json --out /work/rc36/steps-$name-pad-$setting.md > /work/rc36/steps-$name-$setting.log 2>&1
  done
done
echo done > /work/rc36/steps.done
