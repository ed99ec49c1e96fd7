#!/usr/bin/env bash
# The PowerNorm paper's Figure 5: BLEU against the batch size that the
# normalisation statistics see, with the optimizer's batch held at 4K tokens
# by gradient accumulation (--max-tokens B, --update-freq 4096/B).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # ROOT, whole, tied
whole "$@"
environment  # fairseq and the tools, from .venv if no environment is active

usage() {
  cat <<USAGE
usage: scripts/batch-ablation.sh [--norms "bn pn"] [--sizes "512 1024 2048 4096"] [--dataset NAME]
                                 [--data DIR] [--out DIR] [--seed N] [--gpus N] [-- FAIRSEQ_FLAGS...]

  --norms LIST     encoder norms to compare (default: "bn pn", as the figure)
  --sizes LIST     statistics batch sizes in tokens; each must divide 4096
                   (default: "512 1024 2048 4096")
  --dataset NAME   iwslt14 | quickstart (default: iwslt14)
  --data DIR       binarized data (default: data-bin/<dataset>/bin)
  --out DIR        runs and the result table (default: checkpoints/batch-ablation)
  --seed N, --gpus N, -- FLAGS   as scripts/train.sh
Writes OUT/figure5.csv (norm, stat_batch_tokens, update_freq, bleu, sacrebleu).
USAGE
}
die() { echo "batch-ablation.sh: error: $*" >&2; exit 2; }

NORMS="bn pn" SIZES="512 1024 2048 4096" DATASET=iwslt14 DATA="" OUT=checkpoints/batch-ablation SEED=1 GPUS=0
EXTRA=()
declare -A OPTIONS=([--norms]=NORMS [--sizes]=SIZES [--dataset]=DATASET [--data]=DATA [--out]=OUT
                   [--seed]=SEED [--gpus]=GPUS [--]=EXTRA)
parse_options "$@"
[[ "$DATASET" == iwslt14 || "$DATASET" == quickstart ]] || die "--dataset must be one of {iwslt14,quickstart}, got '$DATASET'"
TOTAL=4096
for b in $SIZES; do
  [[ "$b" =~ ^[1-9][0-9]*$ ]] && (( TOTAL % b == 0 )) || die "--sizes: each size must divide $TOTAL, got '$b'"
done
DATA="${DATA:-data-bin/$DATASET/bin}"
mkdir -p "$OUT"

rows=()
for norm in $NORMS; do
  for b in $SIZES; do
    freq=$(( TOTAL / b / (GPUS > 0 ? GPUS : 1) ))
    (( freq >= 1 )) || die "$GPUS GPUs x $b tokens exceed the $TOTAL-token batch"
    run="$OUT/$norm-stat$b-seed$SEED"
    tied bash "$ROOT/scripts/train.sh" --dataset "$DATASET" --data "$DATA" --norm "$norm" --seed "$SEED" \
      --gpus "$GPUS" --tokens-per-update "$TOTAL" --update-freq "$freq" --save-dir "$run" -- --max-tokens "$b" "${EXTRA[@]}"
    tied bash "$ROOT/scripts/evaluate.sh" --dataset "$DATASET" --data "$DATA" --save-dir "$run"
    rows+=("$norm $b $freq $run/bleu-test.json")
  done
done

python - "$OUT/figure5.csv" "${rows[@]}" <<'PY'
import csv, json, sys
out, rows = sys.argv[1], sys.argv[2:]
with open(out, "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["norm", "stat_batch_tokens", "update_freq", "bleu", "sacrebleu", "checkpoints_averaged"])
    for row in rows:
        norm, b, freq, path = row.split()
        r = json.load(open(path))
        w.writerow([norm, b, freq, r["bleu"][0], r["sacrebleu"][0], r["checkpoints_averaged"]])
print(open(out).read(), end="")
PY
echo "batch-ablation.sh: table in $OUT/figure5.csv" >&2
