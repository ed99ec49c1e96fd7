#!/usr/bin/env bash
# Perplexity of a language model from scripts/train-lm.sh with fairseq-eval-lm,
# scoring every token with a context window as fairseq's language-model recipe does.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # ROOT, whole, temporary, tied
whole "$@"
environment  # fairseq and the tools, from .venv if no environment is active

usage() {
  cat <<USAGE
usage: scripts/evaluate-lm.sh --save-dir DIR [--dataset NAME] [options]

  --save-dir DIR       the run's checkpoint directory (required)
  --dataset NAME       ptb | wikitext103 (default: ptb)
  --data DIR           binarized data (default: data-bin/<dataset>/bin)
  --context-window N   score each token with at least N tokens of context, in blocks
                       as long as the model's training blocks (default: 3/4 of them)
  --checkpoint NAME    checkpoint file in DIR (default: checkpoint_best.pt)
  --subset NAME        test | valid (default: test)
  --cpu                evaluate on the CPU
Writes DIR/perplexity-<subset>.json and prints the perplexity.
USAGE
}

die() { echo "evaluate-lm.sh: error: $*" >&2; exit 2; }

DATASET=ptb SAVE_DIR="" DATA="" CHECKPOINT=checkpoint_best.pt SUBSET=test CONTEXT="" CPU=()
declare -A OPTIONS=([--save-dir]=SAVE_DIR [--dataset]=DATASET [--data]=DATA [--checkpoint]=CHECKPOINT
                   [--subset]=SUBSET [--context-window]=CONTEXT [--cpu]=CPU=--cpu)
parse_options "$@"
[[ -n "$SAVE_DIR" ]] || { usage >&2; die "--save-dir is required"; }
[[ -d "$SAVE_DIR" ]] || die "--save-dir: no such directory '$SAVE_DIR'"
# the translations, logs and scores go beside the checkpoints
writable "$SAVE_DIR" || die "--save-dir: cannot write into '$SAVE_DIR' (a read-only file system or no permission); copy the checkpoints to a writable directory"
[[ "$DATASET" == ptb || "$DATASET" == wikitext103 ]] || die "--dataset must be one of {ptb,wikitext103}, got '$DATASET'"
[[ "$SUBSET" == test || "$SUBSET" == valid ]] || die "--subset must be one of {test,valid}, got '$SUBSET'"
DATA="${DATA:-data-bin/$DATASET/bin}"
[[ -f "$DATA/dict.txt" ]] || die "no binarized data in '$DATA' (pass --data)"
CKPT="$SAVE_DIR/$CHECKPOINT"
[[ -f "$CKPT" ]] || die "--checkpoint: no such file '$CKPT'"
# through the plugin's weights-only reader: a checkpoint that holds code is refused, not run
BLOCK=$(python -c "
import sys
from powernorm_fairseq.common.checkpoints import load, model_setting
from powernorm_fairseq.common.errors import InputFileError
try:
    state = load(sys.argv[1])
except InputFileError as err:
    sys.exit(str(err))
block = model_setting(state, 'tokens_per_sample')
print(block or sys.exit(sys.argv[1] + ': no training block size (tokens_per_sample) in it'))
" "$CKPT" 2>&1) || die "$(tail -n 1 <<<"$BLOCK")"
BLOCK=$(tail -n 1 <<<"$BLOCK")  # the number, after whatever the imports printed
CONTEXT="${CONTEXT:-$(( BLOCK * 3 / 4 ))}"
[[ "$CONTEXT" =~ ^[0-9]+$ && "$CONTEXT" -lt "$BLOCK" ]] \
  || die "--context-window must be an integer in [0, $BLOCK) for this model, got '$CONTEXT'"

LOG="$SAVE_DIR/eval-lm-$SUBSET.log"
temporary "$LOG.tmp" "$SAVE_DIR/perplexity-$SUBSET.json.tmp"
fresh "$LOG" "$SAVE_DIR/perplexity-$SUBSET.json"
tied fairseq-eval-lm "$DATA" --user-dir "$ROOT/powernorm_fairseq" --path "$CKPT" --gen-subset "$SUBSET" \
  --sample-break-mode none --tokens-per-sample "$BLOCK" --context-window "$CONTEXT" \
  --batch-size 2 "${CPU[@]}" > "$LOG.tmp" 2>&1 || { mv "$LOG.tmp" "$LOG"; tail -n 3 "$LOG" >&2; die "fairseq-eval-lm failed (log: $LOG)"; }
mv "$LOG.tmp" "$LOG"

python - "$LOG" "$SAVE_DIR/perplexity-$SUBSET.json" "$CKPT" "$DATASET" "$SUBSET" "$CONTEXT" <<'PY'
import json, os, re, sys
log, out, ckpt, dataset, subset, context = sys.argv[1:]
text = open(log, encoding="utf-8").read()
tokens = [int(n.replace(",", "")) for n in re.findall(r"Evaluated ([0-9,]+) tokens", text)]  # 16,695
found = re.findall(r"Loss \(base 2\): ([0-9.]+), Perplexity: ([0-9.]+)", text)
if not found:
    sys.exit(f"evaluate-lm.sh: error: no perplexity in {log}")
loss, ppl = map(float, found[-1])
if not tokens or tokens[-1] == 0:
    sys.exit(f"evaluate-lm.sh: error: no token was scored (see {log})")
result = {"dataset": dataset, "subset": subset, "checkpoint": ckpt, "context_window": int(context),
          "tokens": tokens[-1], "loss_base2": loss, "perplexity": ppl}
with open(out + ".tmp", "w") as f:
    json.dump(result, f, indent=1)
os.replace(out + ".tmp", out)
print(f"{ckpt} ({subset}, {tokens[-1]} tokens, context >= {context}): perplexity {ppl:.2f}")
PY
