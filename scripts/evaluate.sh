#!/usr/bin/env bash
# Average the last checkpoints of a run, translate the test set and score it
# exactly as the PowerNorm paper reports BLEU, plus sacreBLEU with its signature.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # ROOT, whole, temporary, tied
whole "$@"
environment  # fairseq and the tools, from .venv if no environment is active

usage() {
  cat <<USAGE
usage: scripts/evaluate.sh --save-dir DIR [--dataset NAME] [options]

  --save-dir DIR     the run's checkpoint directory (required)
  --dataset NAME     iwslt14 | wmt14 | quickstart (default: iwslt14); picks the
                     beam, length penalty and BLEU definition of the paper:
                     iwslt14/quickstart: beam 5, lenpen 1.0, tokenized case-insensitive BLEU
                     wmt14: beam 4, lenpen 0.6, tokenized case-sensitive compound-split BLEU
  --data DIR         binarized data (default: data-bin/<dataset>/bin)
  --raw-ref FILE     untokenized test reference for sacreBLEU
                     (default: <data>/../raw/test.<tgt> if present)
  --average N        average the last N epoch checkpoints (default: 10 iwslt14
                     and wmt14, as the paper; 3 quickstart; 1 = checkpoint_last.pt alone)
  --subset NAME      test | valid (default: test)
  --cpu              generate on the CPU
  --verbose          show fairseq-generate's log (always kept in DIR/generate.log)
USAGE
}

die() { echo "evaluate.sh: error: $*" >&2; exit 2; }

DATASET=iwslt14 SAVE_DIR="" DATA="" RAW_REF="" AVERAGE="" SUBSET=test CPU=()
declare -A OPTIONS=([--save-dir]=SAVE_DIR [--dataset]=DATASET [--data]=DATA [--raw-ref]=RAW_REF
                   [--average]=AVERAGE [--subset]=SUBSET [--cpu]=CPU=--cpu [--verbose]=VERBOSE=1)
parse_options "$@"
export VERBOSE
[[ -n "$SAVE_DIR" ]] || { usage >&2; die "--save-dir is required"; }
[[ -d "$SAVE_DIR" ]] || die "--save-dir: no such directory '$SAVE_DIR'"
# one scoring of a run at a time (the local launcher and a SLURM job of the same run, two reruns): a lock on
# the directory itself, which leaves nothing behind and is dropped when this script ends however it ends
exec 9<"$SAVE_DIR"
flock -n 9 || die "another evaluate.sh is scoring '$SAVE_DIR' now; wait for it to end"
# the translations, logs and scores go beside the checkpoints
writable "$SAVE_DIR" || die "--save-dir: cannot write into '$SAVE_DIR' (a read-only file system or no permission); copy the checkpoints to a writable directory"
case "$DATASET" in
  iwslt14) BEAM=5 LENPEN=1.0 BLEU=iwslt14 SRC=de TGT=en N=10 ;;
  quickstart) BEAM=5 LENPEN=1.0 BLEU=iwslt14 SRC=de TGT=en N=3 ;;
  wmt14) BEAM=4 LENPEN=0.6 BLEU=wmt14 SRC=en TGT=de N=10 ;;
  *) die "--dataset must be one of {iwslt14,wmt14,quickstart}, got '$DATASET'" ;;
esac
[[ "$SUBSET" == test || "$SUBSET" == valid ]] || die "--subset must be one of {test,valid}, got '$SUBSET'"
AVERAGE="${AVERAGE:-$N}"
[[ "$AVERAGE" =~ ^[1-9][0-9]*$ ]] || die "--average must be a positive integer, got '$AVERAGE'"
DATA="${DATA:-data-bin/$DATASET/bin}"
[[ -f "$DATA/dict.$TGT.txt" ]] || die "no binarized data in '$DATA' (pass --data)"
if [[ -z "$RAW_REF" && -f "$DATA/../raw/$SUBSET.$TGT" ]]; then
  RAW_REF="$DATA/../raw/$SUBSET.$TGT"
fi

if [[ "$AVERAGE" == 1 ]]; then
  CKPT="$SAVE_DIR/checkpoint_last.pt"
  [[ -f "$CKPT" ]] || die "no checkpoint_last.pt in '$SAVE_DIR'"
else
  CKPT="$SAVE_DIR/averaged_last_$AVERAGE.pt"
fi
OUT="$SAVE_DIR/generate-$SUBSET-$(basename "$CKPT" .pt).txt"
LOG="$SAVE_DIR/generate.log"
SCORES="$SAVE_DIR/bleu-$SUBSET.json"
fresh "$LOG" "$OUT" "$OUT.hyp" "$SCORES"
# the previous run's translation and score go before the model they would be taken for is made again: a run
# stopped half-way leaves no score beside a model it is not of (each score names its checkpoints)
rm -f -- "$OUT" "$OUT.hyp" "$SCORES"
if [[ "$AVERAGE" != 1 ]]; then
  tied powernorm-average --inputs "$SAVE_DIR" --num-epoch-checkpoints "$AVERAGE" --output "$CKPT"
fi

# the subwords are undone as the data was made: a sentencepiece model saved
# beside the data (data-prep --bpe sentencepiece), else subword-nmt's "@@ "
DECODE=(--remove-bpe)
[[ -f "$DATA/spm.model" ]] && DECODE=(--post-process sentencepiece)

echo "evaluate.sh: translating $SUBSET with $(basename "$CKPT") (beam $BEAM, lenpen $LENPEN); log: $LOG" >&2
generate=(fairseq-generate "$DATA" --user-dir "$ROOT/powernorm_fairseq" --path "$CKPT"
  --gen-subset "$SUBSET" --source-lang "$SRC" --target-lang "$TGT"
  --beam "$BEAM" --lenpen "$LENPEN" "${DECODE[@]}" --batch-size 128 "${CPU[@]}"
  --required-batch-size-multiple 1)  # fairseq drops a last batch that is not a multiple
temporary "$OUT.tmp" "$OUT.hyp.tmp"
if [[ -n "${VERBOSE:-}" ]]; then
  tied "${generate[@]}" > "$OUT.tmp" 2> >(tied tee -a "$LOG" >&2)
else
  tied "${generate[@]}" > "$OUT.tmp" 2>> "$LOG" || { rm -f "$OUT.tmp"; die "fairseq-generate failed: $(tail -n 1 "$LOG")"; }
fi
mv "$OUT.tmp" "$OUT"
grep '^H-' "$OUT" | sort -t- -k2 -n | cut -f3 > "$OUT.hyp.tmp"
mv "$OUT.hyp.tmp" "$OUT.hyp"

REF_ARGS=()
[[ -n "$RAW_REF" ]] && REF_ARGS=(--raw-ref "$RAW_REF")
echo "$SAVE_DIR ($SUBSET, beam $BEAM, lenpen $LENPEN):"
powernorm-score "$OUT" --bleu "$BLEU" --target-lang "$TGT" --checkpoints "$AVERAGE" --checkpoint "$CKPT" \
  --json "$SCORES" "${REF_ARGS[@]}"
