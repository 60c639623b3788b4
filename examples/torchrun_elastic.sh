#!/bin/bash
# Elastic training with torchrun: on a worker failure torchrun restarts all workers
# (up to --max-restarts); each resumes from the newest committed version, and the new
# versions record TORCHELASTIC_RESTART_COUNT in their metadata (`forkpoint log` shows it).
set -euo pipefail
REPO=${REPO:-runs/elastic}
NPROC=${NPROC:-2}
exec torchrun --nnodes=1 --nproc-per-node="$NPROC" --max-restarts=3 \
    --rdzv-backend=c10d --rdzv-endpoint=localhost:29400 \
    examples/train.py --repo "$REPO" --steps "${STEPS:-500}"
