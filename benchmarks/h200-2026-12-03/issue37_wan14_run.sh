#!/bin/bash
# Issue 37, third call: Wan2.1-14B CFG step with FP8 linear + sage2 compiled, beside
# fp8_compiled (FP8 linear + fp8_cudnn compiled) in the same run.
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")"
HERE=$PWD; W=/tmp/w37c; mkdir -p $W
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
if ! PYTHONPATH=/tmp/site python3 -c "import sageattention._qattn_sm90" 2>/dev/null; then
  echo "== install_offline.sh (reuses the built wheel) at $(el)s"
  bash bundle/install_offline.sh bundle/ --target /tmp/site > $W/install.log 2>&1
  echo "install rc=$? at $(el)s"
fi
export PYTHONPATH=/tmp/site:$HERE:$HERE/fa3so
echo "== Wan2.1-14B at $(el)s"
timeout 470 python3 -m scripts.bench.bench_dit suite --arch wan-14b --models /dev/shm/m14 \
  --work /dev/shm/w14 --steps 2 --repeats 1 --variants fp8_compiled,sage2_compiled --out $W/wan14
cp $W/wan14/bench_dit.json $OUT/wan14.json 2>/dev/null
echo "== done at $(el)s"
