#!/usr/bin/env bash
# The language-modeling corpora of the PowerNorm paper, as fairseq's
# examples/language_model prepare them: the published word-level text (already
# tokenized, rare words as <unk>), binarized with fairseq-preprocess --only-source.
#   ptb:         Penn Treebank, Mikolov et al. (2011) split: 0.93M/73K/82K tokens, 10K words
#   wikitext103: WikiText-103 (Merity et al., 2017): 103M/218K/246K tokens, 267K words
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/lib.sh"
whole "$@"
environment  # fairseq and the tools, from .venv if no environment is active

DATASET="" ARCHIVE="" OUT="" FORCE=""

usage() {
  cat <<USAGE
usage: data-prep/prepare-lm.sh --dataset {ptb,wikitext103} [--archive PATH] [--out DIR] [--force]

  --dataset NAME   ptb (simple-examples.tgz) or wikitext103 (wikitext-103-v1.zip)
  --archive PATH   a local copy of that archive (default: download it)
  --out DIR        output directory (default: data-bin/NAME): DIR/bin is the
                   binarized data, DIR/tmp the extracted text
  --force          prepare again even if DIR is complete
USAGE
}

declare -A OPTIONS=([--dataset]=DATASET [--archive]=ARCHIVE [--out]=OUT [--force]=FORCE=1)
parse_options "$@"

case "$DATASET" in
  ptb)
    URL="http://www.fit.vutbr.cz/~imikolov/rnnlm/simple-examples.tgz"
    MEMBER="simple-examples/data/ptb.%s.txt" ;;
  wikitext103)
    URL="https://wikitext.smerity.com/wikitext-103-v1.zip"
    MEMBER="wikitext-103/wiki.%s.tokens" ;;
  *) usage >&2; die "--dataset must be one of {ptb,wikitext103}, got '$DATASET'" ;;
esac
OUT="${OUT:-data-bin/$DATASET}"

hold "$OUT" "$FORCE"
if [[ -f "$OUT/bin/.done" && -z "$FORCE" ]]; then
  log "$OUT is already prepared (use --force to redo it)"
  exit 0
fi
mkdir -p "$OUT/orig" "$OUT/tmp"

if [[ -z "$ARCHIVE" ]]; then
  ARCHIVE="$OUT/orig/$(basename "$URL")"
  fetch "$URL" "$ARCHIVE" "--archive PATH"
fi
[[ -f "$ARCHIVE" ]] || die "--archive: no such file '$ARCHIVE'"

log "extracting the train/valid/test text of $DATASET"
for split in train valid test; do
  # shellcheck disable=SC2059
  extract_member "$ARCHIVE" "$(printf "$MEMBER" "$split")" "$OUT/tmp/$split.txt"
done

log "binarizing (fairseq-preprocess --only-source)"
binarize_lm "$OUT/tmp" "$OUT/bin"
log "done: $OUT/bin ($(($(wc -l < "$OUT/bin/dict.txt") + 4)) symbols)"
