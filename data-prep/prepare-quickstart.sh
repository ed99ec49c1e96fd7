#!/usr/bin/env bash
# Tokenize, BPE and binarize the small German-English corpus shipped in
# data-prep/quickstart (see its README for where it comes from).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/lib.sh"

SRC_DIR="$HERE/quickstart"
OUT=data-bin/quickstart
BPE_MERGES=4000  # ~100k tokens per side: a small vocabulary keeps every type frequent
FORCE=""

usage() {
  cat <<USAGE
usage: data-prep/prepare-quickstart.sh [--src-dir DIR] [--out DIR] [--bpe-merges N] [--force]

  --src-dir DIR     raw train/valid/test.{de,en} (default: data-prep/quickstart)
  --out DIR         where to write (default: data-bin/quickstart); the binarized
                    data goes to DIR/bin, intermediate files to DIR/tmp
  --bpe-merges N    joint BPE merges (default: $BPE_MERGES)
  --force           redo everything even if DIR is already prepared
USAGE
}

while [[ $# -gt 0 ]]; do
  case "$1" in
    --src-dir) SRC_DIR="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --bpe-merges) BPE_MERGES="$2"; shift 2 ;;
    --force) FORCE=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown option '$1'" ;;
  esac
done
[[ "$BPE_MERGES" =~ ^[1-9][0-9]*$ ]] || die "--bpe-merges must be a positive integer, got '$BPE_MERGES'"
for split in train valid test; do
  for lang in de en; do
    [[ -s "$SRC_DIR/$split.$lang" ]] || die "missing or empty input file: $SRC_DIR/$split.$lang"
  done
done

if [[ -f "$OUT/bin/.done" && -z "$FORCE" ]]; then
  log "$OUT is already prepared (use --force to redo it)"
  exit 0
fi
[[ -n "$FORCE" ]] && rm -rf "$OUT"
mkdir -p "$OUT/tmp" "$OUT/raw"

log "tokenizing (sacremoses, $WORKERS workers)"
for split in train valid test; do
  for lang in de en; do
    run_step "$OUT/raw/$split.$lang" cat "$SRC_DIR/$split.$lang"
    tokenize "$lang" "$SRC_DIR/$split.$lang" "$OUT/tmp/$split.tok.$lang"
  done
done
log "learning joint BPE with $BPE_MERGES merges (subword-nmt)"
learn_bpe "$BPE_MERGES" "$OUT/tmp/codes" "$OUT/tmp/train.tok.de" "$OUT/tmp/train.tok.en"
for split in train valid test; do
  for lang in de en; do
    apply_bpe "$OUT/tmp/codes" "$OUT/tmp/$split.tok.$lang" "$OUT/tmp/$split.$lang"
  done
done
log "binarizing (fairseq-preprocess --joined-dictionary)"
binarize de en "$OUT/tmp" "$OUT/bin"
log "done: $OUT/bin (raw references in $OUT/raw)"
