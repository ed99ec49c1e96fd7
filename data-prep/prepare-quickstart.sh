#!/usr/bin/env bash
# Tokenize, BPE and binarize the small German-English corpus shipped in
# data-prep/quickstart (see its README for where it comes from).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/lib.sh"
whole "$@"
environment  # fairseq and the tools, from .venv if no environment is active

SRC_DIR="$HERE/quickstart"
OUT=data-bin/quickstart
BPE=subword-nmt
BPE_SIZE=4000  # ~100k tokens per side: a small vocabulary keeps every type frequent
FORCE=""

usage() {
  cat <<USAGE
usage: data-prep/prepare-quickstart.sh [--src-dir DIR] [--out DIR] [--bpe METHOD] [--bpe-size N] [--force]

  --src-dir DIR     raw train/valid/test.{de,en} (default: data-prep/quickstart)
  --out DIR         where to write (default: data-bin/quickstart); the binarized
                    data goes to DIR/bin, intermediate files to DIR/tmp
  --bpe METHOD      subword-nmt | sentencepiece (default: $BPE); a sentencepiece
                    model is saved as DIR/bin/$SPM_MODEL, beside the data
  --bpe-size N      subword-nmt merges, or the sentencepiece vocabulary size
                    (default: $BPE_SIZE); --bpe-merges N is the same
  --force           redo everything even if DIR is already prepared
USAGE
}

declare -A OPTIONS=([--src-dir]=SRC_DIR [--out]=OUT [--bpe]=BPE [--bpe-size]=BPE_SIZE [--bpe-merges]=BPE_SIZE
                   [--force]=FORCE=1)
parse_options "$@"
check_subwords "$BPE" "$BPE_SIZE"
for split in train valid test; do
  for lang in de en; do
    [[ -s "$SRC_DIR/$split.$lang" ]] || die "missing or empty input file: $SRC_DIR/$split.$lang"
  done
done

hold "$OUT" "$FORCE"
if [[ -z "$FORCE" ]] && prepared "$OUT" "$BPE"; then
  exit 0
fi
mkdir -p "$OUT/tmp" "$OUT/raw"

log "tokenizing (sacremoses)"
for split in train valid test; do
  for lang in de en; do
    run_step "$OUT/raw/$split.$lang" cat "$SRC_DIR/$split.$lang"
    tokenize "$lang" "$SRC_DIR/$split.$lang" "$OUT/tmp/$split.tok.$lang"
  done
done
log "learning joint subwords ($BPE, size $BPE_SIZE)"
MODEL=$(subword_model "$OUT/tmp" "$BPE")
learn_subwords "$BPE" "$BPE_SIZE" "$MODEL" "$OUT/tmp/train.tok.de" "$OUT/tmp/train.tok.en"
for split in train valid test; do
  for lang in de en; do
    apply_subwords "$BPE" "$MODEL" "$OUT/tmp/$split.tok.$lang" "$OUT/tmp/$split.$lang"
  done
done
log "binarizing (fairseq-preprocess --joined-dictionary)"
BESIDE=("$MODEL")
binarize de en "$OUT/tmp" "$OUT/bin"
log "done: $OUT/bin (raw references in $OUT/raw)"
