#!/bin/sh
# Redraws average_accuracy.png and first_task_accuracy.png (and plotted.md) from the saved accuracy matrices.
# Run from the repository root: sh docs/results/discrete_pmnist/plot.sh
D=docs/results/discrete_pmnist
foovb plot \
  $D/foovb_kronecker_antithetic_cov_step0.1_accuracy_matrix_mean.csv \
  $D/foovb_diagonal_growth_none_antithetic_cov_step0.3_eta0.7_accuracy_matrix_mean.csv \
  $D/foovb_diagonal_accuracy_matrix_mean.csv \
  $D/ewc_online_seed0_1thread_accuracy_matrix_mean.csv \
  $D/mas_seed0_1thread_accuracy_matrix_mean.csv \
  $D/adagrad_seed0_1thread_accuracy_matrix_mean.csv \
  $D/sgd_seed0_1thread_accuracy_matrix_mean.csv \
  $D/adam_seed0_1thread_accuracy_matrix_mean.csv \
  $D/joint_seed0_1thread_accuracy_matrix_mean.csv \
  --labels "FOO-VB matrix-variate, antithetic, beta 0.1" \
           "FOO-VB diagonal, Lemma 2 root, antithetic, beta 0.3, eta 0.7" \
           "FOO-VB diagonal, paper settings" "online EWC (Adam)" "MAS (SGD)" Adagrad SGD Adam \
           "joint training (oracle)" \
  --out $D
