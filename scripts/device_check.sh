#!/bin/bash
# The GPU checks of one lent device session, as one command (docs/performance.md, "On a GPU"): the GPU tests
# (tests/test_gpu.py, the runner's), the timing tables (each ratio measured in its own run), then training runs side by side until a deadline;
# SIGTERM checkpoints them, and each run directory comes back as one tar file (checkpoint included, so that a later
# session resumes it). From the repository root, with the data directory carried into the checkout:
#
#   OUT=/path/to/results DATA=gpu_data DEADLINE=470 bash scripts/device_check.sh [RUN ...]
#
# RUN: config[:seed[:agnostic]] of configs/, e.g. mnist_fashion_foovb_diagonal:0 or
# mnist_fashion_sgd:0:agnostic (scenario.task_agnostic=true) (default: the paper-scale MNIST ->
# Fashion-MNIST matrix-variate runs, task-aware and task-agnostic, seed 0: the rows of issue 59 still missing, about
# 28 minutes each alone on an H200, so more than one lent session's); a run found in runs/device/ is resumed (untar the returned files there and
# carry runs/device with the next call). DEVICE (default cuda): the runs'
# device. TABLES=0 skips the GPU test and the timing tables (all the time to the runs). Needs torch with CUDA, numpy, matplotlib, pyyaml, tqdm and pytest (the device image has them).
set -u
START=$(date +%s); END=$((START + ${DEADLINE:-470}))
export PYTHONPATH=$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1
mkdir -p "$OUT"; T=$OUT/tables.txt
elapsed() { echo $(($(date +%s) - START)); }
(
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
  [ "${TABLES:-1}" = 0 ] && exit 0
  echo "== GPU test ($(elapsed) s)"
  timeout 180 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_runner.py -k gpu || echo "GPU TEST FAILED"
  for cmd in "step_time.py --device cuda --sizes 1024,200,200,10 --repeats 30 --ks 1,10" \
             "closure_path.py --device cuda --repeats 30" "lenet_step.py --device cuda --repeats 20"; do
    echo "== $cmd ($(elapsed) s)"
    (cd benchmarks && timeout 100 python3 $cmd)
  done
) > "$T" 2>&1
left=$((END - $(date +%s))); [ $left -lt 60 ] && left=60
echo "== runs start at $(elapsed) s, ${left} s each" >> "$T"
runs=("$@"); [ ${#runs[@]} = 0 ] && runs=(mnist_fashion_foovb_kronecker:0 mnist_fashion_foovb_kronecker:0:agnostic)
mkdir -p runs/device
# parse SPEC: sets config, seed, name (the run directory's name) and extra (the run's --set for the variant)
parse() {
  IFS=: read -r config seed variant <<< "$1"; seed=${seed:-0}; name=${config}_s$seed; extra=()
  case "$variant" in
    "") ;;
    agnostic) name=${name}_agnostic; extra=(--set scenario.task_agnostic=true) ;;
    *) echo "device_check.sh: unknown variant '$variant' in $1 (known: agnostic)" >&2; exit 2 ;;
  esac
}
for spec in "${runs[@]}"; do parse "$spec"; done  # every spec checked before any run starts
for spec in "${runs[@]}"; do
  parse "$spec"; out=runs/device/$name
  if [ -f $out/checkpoint.pt ]; then r=--resume; else r=; fi
  data=(); grep -q "kind: vision_mix" configs/$config.yaml && data=(--set scenario.data_dir="${DATA:-data}")
  timeout -s TERM -k 60 $left python3 -m foovb_suite run configs/$config.yaml --set device=${DEVICE:-cuda} --set threads=2 \
    "${data[@]}" "${extra[@]}" --set seed=$seed --set scenario.seed=$seed --out $out $r > $out.log 2>&1 &
done
wait
echo "== runs ended at $(elapsed) s" >> "$T"
for spec in "${runs[@]}"; do
  parse "$spec"; out=runs/device/$name
  { echo "== $out"; tail -c 400 $out.log | tr '\r' '\n' | tail -n 4; } >> "$T"
  tar czf "$OUT/$name.tgz" -C runs/device $name $name.log
done
cat "$T"
