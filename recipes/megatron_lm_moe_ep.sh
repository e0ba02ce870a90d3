#!/usr/bin/env bash
# A Megatron-LM mixture-of-experts run resumed at another expert-parallel size, with Megatron-LM's own
# pretrain_gpt.py and --ckpt-format bcp, on 2 processes (CPU and gloo where torch sees no GPU): a tiny
# GPT whose MLPs are 4 experts (top-2 routing, aux-loss balancing, alltoall dispatch) trains 6
# iterations at EP=2 with the distributed optimizer's fully reshardable layout, checkpointing at
# iterations 3 and 6; then a second run resumes from the iteration-3 checkpoint at EP=1 and trains
# iterations 4-6 again. Nothing but --expert-model-parallel-size differs between the two commands.
# Printed: both runs' losses and gradient norms as Megatron-LM logs them (its log line after a resume
# can average the losses of the iterations since the load: iteration 5's there is the mean of 4 and 5),
# and the largest difference between the two runs' iteration-6 checkpoints, tensor by tensor, read with
# bcp (which optimizer of the chain holds an expert's state changes with EP: compared without the
# chained_<n>. prefix).
#
#   recipes/megatron_lm_moe_ep.sh /path/to/Megatron-LM [OUT]
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
      --num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0.01
      --disable-bias-linear  # with expert biases Megatron's MLP adds its bias in place on a view: autograd refuses
      --ckpt-format bcp --save-interval 3 --use-distributed-optimizer --dist-ckpt-optim-fully-reshardable)
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

echo "1. EP=2: 6 iterations, bcp checkpoints at 3 and 6 -> $OUT/ep2"
pretrain "$OUT/ep2.log" --expert-model-parallel-size 2 --save "$OUT/ep2" --load "$OUT/ep2"
echo "2. resume the iteration-3 checkpoint at EP=1 -> $OUT/ep1"
mkdir -p "$OUT/ep1" && cp -r "$OUT/ep2/iter_0000003" "$OUT/ep1/" && echo 3 > "$OUT/ep1/latest_checkpointed_iteration.txt"
pretrain "$OUT/ep1.log" --expert-model-parallel-size 1 --save "$OUT/ep1" --load "$OUT/ep1"
grep -q "RNG state will be ignored" "$OUT/ep1.log" && echo "(the resume at EP=1 ignored the RNG state, as for a TP change)"
echo "iteration | EP=2: lm loss, grad norm | resumed at EP=1: lm loss, grad norm"
join <(logged "$OUT/ep2.log") <(logged "$OUT/ep1.log") -a 1 -e "-" -o 0,1.2,1.3,2.2,2.3 | sed 's/ / | /g'
"$PYTHON" - "$OUT/ep2/iter_0000006" "$OUT/ep1/iter_0000006" <<'PY'
import re
import sys
from bcp_core.tools.read import open_checkpoint, read_tensor
(sa, ma), (sb, mb) = open_checkpoint(sys.argv[1]), open_checkpoint(sys.argv[2])
plain = lambda md: {re.sub(r"^chained_\d+\.", "", k): k for k in md.tensors}  # which optimizer holds a tensor changes with EP
pa, pb = plain(ma), plain(mb)
assert pa.keys() == pb.keys(), "the two checkpoints hold different tensors"
worst = max(((read_tensor(sa, ma, pa[k]).double() - read_tensor(sb, mb, pb[k]).double()).abs().max().item(), k)
            for k in pa if ma.tensors[pa[k]].dtype.is_floating_point)
print(f"iteration-6 checkpoints at EP=2 and EP=1: {len(pa)} tensors each, largest difference {worst[0]:.2e} ({worst[1]})")
PY
