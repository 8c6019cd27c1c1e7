#!/bin/bash
# Issue 37, second call: build SageAttention2 through the offline bundle (install_offline.sh,
# ~3 min), then ONE kernel table with cuDNN bf16, fp8_cudnn, sage2 and fa3_fp8 (FA3's .so
# built in the first call, carried in fa3so/), then Wan2.1-1.3B's one-forward error.
#   carry [".dev/wt37"]; command: bash .dev/wt37/run37b.sh 2>&1 | tee $OUT/run.log
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")"
HERE=$PWD; W=/tmp/w37; mkdir -p $W
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "== install_offline.sh (builds sage2) at $(el)s"
bash bundle/install_offline.sh bundle/ --target /tmp/site > $W/install.log 2>&1
echo "install rc=$? at $(el)s (rc 1 expected: this slim bundle has no av, mooncake)"
grep "build_sage2\|sage2:\|import check\|: No module" $W/install.log
for f in bundle/built/sage2/*/*.whl; do cp "$f" "$OUT/$(basename "$f" | tr + _)"; done
export PYTHONPATH=/tmp/site:$HERE:$HERE/fa3so
echo "== kernel table at $(el)s"
timeout 200 python3 -m scripts.bench.bench_attn --out $W/attn --kernels fp8_cudnn,sage2,fa3_fp8
cp $W/attn/attn.json $OUT/attn.json
echo "== Wan2.1-1.3B one forward at $(el)s"
timeout 200 python3 -m scripts.bench.bench_dit suite --arch wan-1.3b --models /dev/shm/m37 \
  --work /dev/shm/w13 --steps 2 --repeats 1 \
  --variants bf16,fp8_attention,sage2_attention,fa3_attention --out $W/wan13
cp $W/wan13/bench_dit.json $OUT/wan13.json
echo "== done at $(el)s"
