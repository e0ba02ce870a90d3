#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py with --ckpt-format bcp, on 2 processes (CPU and gloo where torch sees
# no GPU): a tiny GPT on mock data trains 6 iterations at tensor-parallel size 2 with the distributed
# optimizer, checkpointing asynchronously at iterations 3 and 6; then a second run resumes from the
# iteration-3 checkpoint at TP=1 (data-parallel 2) and trains iterations 4-6 again. Printed: both runs'
# gradient norms and losses as Megatron-LM logs them (its log line after a resume can average the
# losses of the iterations since the load: iteration 5's there is the mean of 4 and 5), and the
# largest difference between the two runs' iteration-6 checkpoints, tensor by tensor, read with bcp.
#
#   recipes/megatron_lm_pretrain.sh /path/to/Megatron-LM [OUT]
#
# /path/to/Megatron-LM: a checkout (core_v0.16 to core_v0.19; 0.17 and later need Python 3.12).
# OUT (default: a new temporary folder) keeps the checkpoints and the logs. PYTHON: the interpreter
# with torch, megatron-core's dependencies and bcp-checkpoint[megatron] installed (default: python3).
set -euo pipefail
MLM=$(cd "${1:?usage: $0 /path/to/Megatron-LM [OUT]}" && pwd)
OUT=${2:-$(mktemp -d)}
PYTHON=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
[ -f "$MLM/pretrain_gpt.py" ] || { echo "$MLM has no pretrain_gpt.py: not a Megatron-LM checkout" >&2; exit 2; }
mkdir -p "$OUT"

ARGS=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32
      --micro-batch-size 2 --global-batch-size 4 --train-iters 6 --lr 1e-3 --min-lr 1e-4
      --lr-decay-style cosine --lr-warmup-iters 0 --log-interval 1 --eval-iters 0 --eval-interval 1000
      --seed 1234 --attention-dropout 0 --hidden-dropout 0 --mock-data --tokenizer-type NullTokenizer
      --vocab-size 127 --make-vocab-size-divisible-by 64
      --ckpt-format bcp --save-interval 3 --async-save --use-distributed-optimizer
      --dist-ckpt-optim-fully-reshardable)
MINOR=$(sed -n 's/^MINOR = \([0-9]*\).*/\1/p' "$MLM/megatron/core/package_info.py")
if [ "${MINOR:-0}" -ge 17 ]; then
  ARGS+=(--async-strategy mcore)  # 0.17+: the default, nvrx, needs nvidia-resiliency-ext
fi
if ! "$PYTHON" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  ARGS+=(--distributed-backend gloo --transformer-impl local --no-persist-layer-norm --use-cpu-initialization
         --no-gradient-accumulation-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion
         --no-masked-softmax-fusion --no-rope-fusion)
fi

pretrain() {  # pretrain <log> <megatron arguments...>
  local log=$1; shift
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 2 \
    "$HERE/megatron_lm_pretrain.py" "$MLM/pretrain_gpt.py" "${ARGS[@]}" "$@" > "$log" 2>&1 \
    || { tail -40 "$log" >&2; echo "pretrain_gpt.py failed: $log" >&2; exit 1; }
}
logged() {  # iteration, lm loss, grad norm of each iteration Megatron-LM logged
  grep -o "iteration *[0-9]*/ *[0-9]* .*lm loss: [0-9.E+-]* .*grad norm: [0-9.]*" "$1" \
    | sed -E 's/iteration *([0-9]+)\/.*lm loss: ([0-9.E+-]*) .*grad norm: ([0-9.]*)/\1 \2 \3/'
}

echo "1. TP=2: 6 iterations, bcp checkpoints at 3 and 6 -> $OUT/tp2"
pretrain "$OUT/tp2.log" --tensor-model-parallel-size 2 --save "$OUT/tp2" --load "$OUT/tp2"
echo "2. resume the iteration-3 checkpoint at TP=1, DP=2 -> $OUT/tp1"
mkdir -p "$OUT/tp1" && cp -r "$OUT/tp2/iter_0000003" "$OUT/tp1/" && echo 3 > "$OUT/tp1/latest_checkpointed_iteration.txt"
pretrain "$OUT/tp1.log" --save "$OUT/tp1" --load "$OUT/tp1"
grep -q '"sharded_backend": "bcp"' "$OUT/tp1/iter_0000006/metadata.json" || { echo "iteration 6 is not a bcp checkpoint" >&2; exit 1; }
echo "iteration | TP=2: lm loss, grad norm | resumed at TP=1: lm loss, grad norm"
join <(logged "$OUT/tp2.log") <(logged "$OUT/tp1.log") -a 1 -e "-" -o 0,1.2,1.3,2.2,2.3 | sed 's/ / | /g'
"$PYTHON" - "$OUT/tp2/iter_0000006" "$OUT/tp1/iter_0000006" <<'PY'
import sys
from bcp_core.tools.read import open_checkpoint, read_tensor
(sa, ma), (sb, mb) = open_checkpoint(sys.argv[1]), open_checkpoint(sys.argv[2])
assert ma.tensors.keys() == mb.tensors.keys(), "the two checkpoints hold different tensors"
worst = max(((read_tensor(sa, ma, k).double() - read_tensor(sb, mb, k).double()).abs().max().item(), k)
            for k in ma.tensors if ma.tensors[k].dtype.is_floating_point)
print(f"iteration-6 checkpoints at TP=2 and TP=1: {len(ma.tensors)} tensors each, largest difference "
      f"{worst[0]:.2e} ({worst[1]})")
PY
