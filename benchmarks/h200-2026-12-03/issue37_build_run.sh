#!/bin/bash
# Issue 37 on one H200: build SageAttention2 (through install_offline.sh) and FA3 (hopper/,
# fwd hdim128 only) from source, then the kernel table and the DiT's one-forward error.
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")"
HERE=$PWD
W=/tmp/w37; mkdir -p $W
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( ${DEADLINE:-530} - $(el) )); }
echo "== env"; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
nproc; python3 -c "import torch,sys;print(sys.version.split()[0], torch.__version__, torch.version.cuda)"
nvcc --version | tail -2; for t in git g++ ninja; do echo "$t: $(command -v $t)"; done
python3 -c "import wheel, setuptools; print('wheel', wheel.__version__, 'setuptools', setuptools.__version__)"
ls /usr/local/cuda/lib64/stubs 2>/dev/null | head -3; ldconfig -p | grep libcuda.so | head -2

echo "== FA3 build (background) at $(el)s"
tar -xzf src/fa3-src.tar.gz -C $W
mkdir -p /tmp/fakebin && printf '#!/bin/sh\nexit 0\n' > /tmp/fakebin/git && chmod +x /tmp/fakebin/git
python3 - <<'PY'
p = "/tmp/w37/fa/hopper/setup.py"; t = open(p).read()
old = "from wheel.bdist_wheel import bdist_wheel as _bdist_wheel"
t = t.replace(old, "try:\n    " + old + "\nexcept ImportError:\n    from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel")
open(p, "w").write(t)
PY
( cd $W/fa/hopper && export PATH=/tmp/fakebin:$PATH FLASH_ATTENTION_FORCE_BUILD=TRUE \
  FLASH_ATTENTION_DISABLE_BACKWARD=TRUE FLASH_ATTENTION_DISABLE_SPLIT=TRUE \
  FLASH_ATTENTION_DISABLE_PAGEDKV=TRUE FLASH_ATTENTION_DISABLE_APPENDKV=TRUE \
  FLASH_ATTENTION_DISABLE_LOCAL=TRUE FLASH_ATTENTION_DISABLE_SOFTCAP=TRUE \
  FLASH_ATTENTION_DISABLE_PACKGQA=TRUE FLASH_ATTENTION_DISABLE_FP16=TRUE \
  FLASH_ATTENTION_DISABLE_VARLEN=TRUE FLASH_ATTENTION_DISABLE_CLUSTER=TRUE \
  FLASH_ATTENTION_DISABLE_HDIM64=TRUE FLASH_ATTENTION_DISABLE_HDIM96=TRUE \
  FLASH_ATTENTION_DISABLE_HDIM192=TRUE FLASH_ATTENTION_DISABLE_HDIM256=TRUE \
  FLASH_ATTENTION_DISABLE_SM80=TRUE FLASH_ATTENTION_DISABLE_HDIMDIFF64=TRUE \
  FLASH_ATTENTION_DISABLE_HDIMDIFF192=TRUE MAX_JOBS=6 NVCC_THREADS=2
  s=$(date +%s); timeout $(( ${DEADLINE:-530} - 110 )) python3 setup.py build_ext --inplace > $W/fa3_build.log 2>&1
  echo "fa3 build rc=$? in $(( $(date +%s) - s ))s" | tee -a $W/fa3_build.log ) &
FA_PID=$!

echo "== install_offline.sh (builds sage2) at $(el)s"
s=$(date +%s)
bash bundle/install_offline.sh bundle/ --target /tmp/site > $W/install.log 2>&1; echo "install rc=$? in $(( $(date +%s) - s ))s"
grep -v "^ *$" $W/install.log | grep -iv "warning #\|^ *\^\|ptxas info\|bit-field\|Remark" | tail -40
export PYTHONPATH=/tmp/site:$HERE
export LD_LIBRARY_PATH=$HERE/bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
cp bundle/built/sage2/*/*.whl $OUT/ 2>/dev/null; ls -la bundle/built/sage2/*/ 2>/dev/null
python3 -c "import sageattention, sageattention._qattn_sm90, sageattention._fused; print('sage2 import ok', sageattention.__file__)"

echo "== kernel table: cuDNN bf16, fp8_cudnn, sage2 at $(el)s"
timeout $(( $(left) - 150 )) python3 -m scripts.bench.bench_attn --out $W/attn --kernels fp8_cudnn,sage2
cp $W/attn/attn.json $OUT/attn.json 2>/dev/null

echo "== DiT Wan2.1-1.3B one forward: bf16, fp8_attention, sage2_attention at $(el)s"
timeout $(( $(left) - 100 )) python3 -m scripts.bench.bench_dit suite --arch wan-1.3b --models /dev/shm/m37 \
  --work /dev/shm/w13 --steps 2 --repeats 1 --keep-folder \
  --variants bf16,fp8_attention,sage2_attention --out $W/wan13
cp $W/wan13/bench_dit.json $OUT/wan13.json 2>/dev/null

echo "== waiting for FA3 at $(el)s"
wait $FA_PID; tail -5 $W/fa3_build.log; cp $W/fa3_build.log $OUT/ 2>/dev/null
SO=$(find $W/fa/hopper -name "_C*.so" | head -1); ls -la $SO 2>/dev/null
if [ -n "$SO" ] && [ $(left) -gt 40 ]; then
  export PYTHONPATH=$PYTHONPATH:$W/fa/hopper
  echo "== FA3 kernel table at $(el)s"
  timeout $(left) python3 -m scripts.bench.bench_attn --out $W/attn_fa3 --kernels fa3_fp8 --shapes 480p,720p
  cp $W/attn_fa3/attn.json $OUT/attn_fa3.json 2>/dev/null
  if [ $(left) -gt 50 ]; then
    echo "== DiT fa3_attention at $(el)s"
    timeout $(left) python3 -m scripts.bench.bench_dit suite --arch wan-1.3b --models /dev/shm/m37 \
      --work /dev/shm/w13 --steps 2 --repeats 1 --keep-folder --variants fa3_attention --out $W/wan13
    cp $W/wan13/bench_dit.json $OUT/wan13.json 2>/dev/null
  fi
  [ $(stat -c %s $SO) -lt 16000000 ] && cp $SO $OUT/
fi
echo "== done at $(el)s"
