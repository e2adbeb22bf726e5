#!/usr/bin/env bash
# Every latent-recovery run behind docs/evidence.md, into docs/latent_recovery/ (about 2 hours of one core;
# cells already there are reused, so on the committed tree this only re-tabulates). Usage:
#   bash benchmarks/latent_recovery_evidence.sh [--processes N]
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
run="python benchmarks/latent_recovery.py --steps 3000 ${*:---processes 2}"
out=docs/latent_recovery

# Every objective against the batch size, two views (more seeds where runs are cheap and seeds vary most)
$run --out-dir $out/batch --losses infonce,dcl --forms two_view --batch-sizes 8,16,32,64 --seeds 0,1,2,3,4,5,6,7,8,9,10,11
$run --out-dir $out/batch --losses infonce,dcl --forms two_view --batch-sizes 128,256 --seeds 0,1,2,3,4,5
$run --out-dir $out/batch --losses dclw,eqco,cacr --forms two_view --batch-sizes 8,64,256 --seeds 0,1,2,3,4
$run --out-dir $out/batch --losses infonce,dcl --forms two_view --batch-sizes 512,1024 --seeds 0,1,2
$run --out-dir $out/batch --losses dclw,eqco,cacr --forms two_view --batch-sizes 1024 --seeds 0,1,2
$run --out-dir $out/batch --losses infonce,dcl,dclw,eqco,cacr --forms two_view \
    --batch-sizes 8,16,32,64,128,256,512,1024 --seeds 0,1,2,3,4,5,6,7,8,9,10,11 --report-only   # the whole table

# EqCo: the number of negatives K (MoCo queue) at a fixed batch of 64
$run --out-dir $out/negatives --sweep queue_size --losses infonce,eqco --batch-sizes 64 \
    --queue-sizes 16,64,256,1024 --seeds 0,1,2,3,4

# UniGrad: lambda with the paper's moving average of F (rho 0.99), and with F from the batch alone (rho 0)
for lam in 0.5 2 10 100; do
  $run --out-dir $out/unigrad/rho0.99-lam$lam --losses unigrad --forms two_view --batch-sizes 256 --seeds 0,1,2 --lam $lam
done
for lam in 3 10 30; do
  $run --out-dir $out/unigrad/rho0-lam$lam --losses unigrad --forms two_view --batch-sizes 256 --seeds 0,1,2 \
      --lam $lam --rho 0
done

# The paper's own concentration: vMF kappa 1, model temperature 1 (matched), batch 1024
$run --out-dir $out/kappa1 --losses infonce --forms two_view --batch-sizes 1024 --seeds 0,1,2 --kappa 1 --temperature 1

# The MoCo form (queue of 1024 keys) against the batch size, every objective with a queue form
$run --out-dir $out/queue --losses infonce,dcl,dclw,eqco,cacr --forms queue --queue-batch-sizes 8,64,256 \
    --seeds 0,1,2,3,4
