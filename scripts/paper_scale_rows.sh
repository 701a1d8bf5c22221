#!/bin/sh
# The README's paper-scale matrix-variate rows with FOOVB(model)'s defaults, one seed after another, resumable (rerun
# the same command after an interruption: a finished seed is skipped, an unfinished one resumed from its checkpoint);
# each finished run's plain outputs are copied to docs/results/step_prior_64/paper_scale/<scenario>_s<seed>_s56.
# Run from the repository root: sh scripts/paper_scale_rows.sh discrete|continuous SEED...
set -e
scenario=$1
shift
for seed in "$@"; do
  out=runs/paper_scale/${scenario}_s$seed
  if [ ! -f "$out/summary.json" ]; then
    resume=""
    [ -f "$out/checkpoint.pt" ] && resume="--resume"
    foovb run "configs/${scenario}_pmnist_foovb_kronecker_recommended.yaml" --set "seed=$seed" \
      --set "scenario.seed=$seed" --out "$out" --no-progress $resume
  fi
  published=docs/results/step_prior_64/paper_scale/${scenario}_s${seed}_s56
  mkdir -p "$published"
  cp "$out/summary.json" "$out/config.yaml" "$out/accuracy_matrix_mean.csv" "$published/"
done
