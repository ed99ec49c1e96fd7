#!/usr/bin/env bash
# The main job, offline on a CPU: set up, prepare the shipped German-English
# corpus, train an encoder-PN and an LN transformer for a few minutes each,
# average, translate, and print a BLEU table.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # ROOT, whole, tied: a SIGTERM to this script ends its children too
whole "$@"

usage() {
  cat <<USAGE
usage: scripts/quickstart.sh [--out DIR] [--norms "pn ln"] [--seed N] [--force] [--verbose]

  --out DIR      where data, checkpoints and translations go (default: runs/quickstart)
  --norms LIST   encoder norms to compare (default: "pn ln")
  --seed N       random seed (default: 1)
  --force        redo every step: prepare the data, train and evaluate again (an
                 earlier run is moved aside to DIR/<norm>-seed<N>.before-<time>)
  --verbose      show fairseq's whole output (always kept in each run's
                 train.log and generate.log, and in DIR/data/preprocess.log)
USAGE
}

die() { echo "quickstart.sh: error: $*" >&2; exit 2; }

OUT="$ROOT/runs/quickstart" NORMS="pn ln" SEED=1 FORCE="" VERBOSE="${VERBOSE:-}"
declare -A OPTIONS=([--out]=OUT [--norms]=NORMS [--seed]=SEED [--force]=FORCE=1 [--verbose]=VERBOSE=1)
parse_options "$@"
[[ -z "$VERBOSE" ]] || export VERBOSE

bash "$ROOT/scripts/setup.sh"
source "$ROOT/.venv/bin/activate"
tied bash "$ROOT/data-prep/prepare-quickstart.sh" --out "$OUT/data" ${FORCE:+--force}

# one GPU when there is one, else the CPU
DEVICE=$(python -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')")
if [[ -n "$DEVICE" ]]; then
  GPUS=1 CPU=() && echo "quickstart: training and translating on the GPU ($DEVICE)" >&2
else
  GPUS=0 CPU=(--cpu) && echo "quickstart: training and translating on the CPU (no GPU found)" >&2
fi

for norm in $NORMS; do
  run="$OUT/$norm-seed$SEED"
  if [[ -n "$FORCE" && -e "$run" ]]; then
    aside="$run.before-$(date +%Y%m%d-%H%M%S)"
    mv -- "$run" "$aside" && echo "quickstart: --force: $run moved aside to $aside" >&2
  fi
  if [[ -f "$run/checkpoint_last.pt" ]] && grep -q "done training" "$run/train.log" 2>/dev/null; then
    echo "quickstart: $run already trained (quickstart.sh --force trains it again)" >&2
  else
    tied bash "$ROOT/scripts/train.sh" --dataset quickstart --data "$OUT/data/bin" --norm "$norm" \
      --seed "$SEED" --gpus "$GPUS" --save-dir "$run" -- --log-interval 20
  fi
  if [[ -f "$run/bleu-test.json" && "$run/bleu-test.json" -nt "$run/checkpoint_last.pt" ]]; then
    echo "quickstart: $run already evaluated (quickstart.sh --force redoes it)" >&2
  else
    tied bash "$ROOT/scripts/evaluate.sh" --dataset quickstart --data "$OUT/data/bin" --save-dir "$run" "${CPU[@]}"
  fi
done

echo
echo "Quickstart: encoder norm vs BLEU on the shipped l10n de-en test set (500 sentences)"
python - "$OUT" "$SEED" $NORMS <<'PY'
import json, sys
out, seed, norms = sys.argv[1], sys.argv[2], sys.argv[3:]
print(f"| encoder norm | tokenized BLEU (case-insens.) | sacreBLEU (detok.) | checkpoints averaged |")
print(f"|---|---|---|---|")
for norm in norms:
    r = json.load(open(f"{out}/{norm}-seed{seed}/bleu-test.json"))
    print(f"| {norm} | {r['bleu'][0]:.2f} | {r['sacrebleu'][0]:.2f} | {r['checkpoints_averaged']} |")
print(f"\nsacreBLEU signature: {r['sacrebleu_signature']}")
PY
echo
echo "checkpoints and logs: $OUT/<norm>-seed$SEED/ (train.log, generate.log, tensorboard/, averaged_last_3.pt)"
echo "translations:         $OUT/<norm>-seed$SEED/generate-test-averaged_last_3.txt (.hyp: hypotheses only)"
