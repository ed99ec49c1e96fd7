#!/usr/bin/env bash
# IWSLT14 German-English as fairseq's examples/translation/prepare-iwslt14.sh
# prepares it, with sacremoses and subword-nmt instead of cloned Moses and
# subword-nmt repositories, then binarized with fairseq-preprocess.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/lib.sh"
whole "$@"
environment  # fairseq and the tools, from .venv if no environment is active

URL="http://dl.fbaipublicfiles.com/fairseq/data/iwslt14/de-en.tgz"
SRC=de TGT=en LANG_PAIR=de-en
BPE=subword-nmt BPE_SIZE=10000  # joint BPE merges, as fairseq's recipe
CLEAN_RATIO=1.5 CLEAN_MIN=1 CLEAN_MAX=175
VALID_EVERY=23          # valid = every 23rd line of the cleaned training data
# test = these five sets, concatenated in this order
TEST_SETS="IWSLT14.TED.dev2010 IWSLT14.TEDX.dev2012 IWSLT14.TED.tst2010 IWSLT14.TED.tst2011 IWSLT14.TED.tst2012"
OUT=data-bin/iwslt14 ARCHIVE="" FORCE=""

usage() {
  cat <<USAGE
usage: data-prep/prepare-iwslt14.sh [--archive PATH] [--out DIR] [--bpe METHOD] [--bpe-size N] [--force]

  --archive PATH   a local copy of de-en.tgz (default: download $URL)
  --out DIR        output directory (default: $OUT): DIR/bin is the binarized
                   data, DIR/raw the untokenized test references, DIR/tmp the
                   intermediate files
USAGE
  subword_usage 19
}

declare -A OPTIONS=([--archive]=ARCHIVE [--out]=OUT [--bpe]=BPE [--bpe-size]=BPE_SIZE [--force]=FORCE=1)
parse_options "$@"

check_subwords "$BPE" "$BPE_SIZE"
hold "$OUT" "$FORCE"
if [[ -z "$FORCE" ]] && prepared "$OUT" "$BPE"; then
  exit 0
fi
mkdir -p "$OUT/orig" "$OUT/tmp" "$OUT/raw"

if [[ -z "$ARCHIVE" ]]; then
  ARCHIVE="$OUT/orig/de-en.tgz"
  fetch "$URL" "$ARCHIVE" "--archive PATH"
fi
[[ -f "$ARCHIVE" ]] || die "--archive: no such file '$ARCHIVE'"
members=$(tar tzf "$ARCHIVE" 2>/dev/null) || die "corrupt or unreadable archive: $ARCHIVE"
for m in "train.tags.$LANG_PAIR.$SRC" "train.tags.$LANG_PAIR.$TGT"; do
  grep -qx "$LANG_PAIR/$m" <<<"$members" || die "archive $ARCHIVE lacks $LANG_PAIR/$m (is it IWSLT14 de-en.tgz?)"
done
for t in $TEST_SETS; do
  for l in $SRC $TGT; do
    grep -qx "$LANG_PAIR/$t.$LANG_PAIR.$l.xml" <<<"$members" || die "archive $ARCHIVE lacks $LANG_PAIR/$t.$LANG_PAIR.$l.xml"
  done
done
if [[ ! -f "$OUT/orig/.extracted" ]]; then
  rm -rf "$OUT/orig/$LANG_PAIR"
  tar xzf "$ARCHIVE" -C "$OUT/orig" || die "corrupt archive: $ARCHIVE"
  touch "$OUT/orig/.extracted"
fi
orig="$OUT/orig/$LANG_PAIR" tmp="$OUT/tmp"

log "training data: strip the TED markup, tokenize"
for l in $SRC $TGT; do
  run_step "$tmp/train.tags.raw.$l" bash -c \
    'grep -a -v -e "<url>" -e "<talkid>" -e "<keywords>" "$0" | sed -e "s/<title>//g; s/<\/title>//g; s/<description>//g; s/<\/description>//g"' \
    "$orig/train.tags.$LANG_PAIR.$l"
  tokenize "$l" "$tmp/train.tags.raw.$l" "$tmp/train.tags.tok.$l"
done

log "cleaning: length $CLEAN_MIN-$CLEAN_MAX, ratio $CLEAN_RATIO; lowercasing"
clean_corpus "$tmp/train.tags.tok" "$SRC" "$TGT" "$CLEAN_MIN" "$CLEAN_MAX" "$CLEAN_RATIO" "$tmp/train.tags" lowercase

log "valid/test data: extract the <seg> lines, tokenize, lowercase"
for l in $SRC $TGT; do
  for t in $TEST_SETS; do
    segments "$orig/$t.$LANG_PAIR.$l.xml" "$tmp/$t.raw.$l"
    apostrophes "$tmp/$t.raw.$l" "$tmp/$t.apos.$l"
    tokenize "$l" "$tmp/$t.apos.$l" "$tmp/$t.$l" lowercase
  done
done

log "splitting: valid = every ${VALID_EVERY}rd training line, test = $TEST_SETS"
for l in $SRC $TGT; do
  run_step "$tmp/valid.$l" awk -v n="$VALID_EVERY" 'NR % n == 0' "$tmp/train.tags.$l"
  run_step "$tmp/train.$l" awk -v n="$VALID_EVERY" 'NR % n != 0' "$tmp/train.tags.$l"
  test_files=() raw_files=()
  for t in $TEST_SETS; do test_files+=("$tmp/$t.$l"); raw_files+=("$tmp/$t.raw.$l"); done
  run_step "$tmp/test.$l" cat "${test_files[@]}"
  run_step "$OUT/raw/test.$l" cat "${raw_files[@]}"
done

joint_subwords "$tmp" "" ""

log "binarizing (fairseq-preprocess --joined-dictionary)"
BESIDE=("$MODEL")
binarize "$SRC" "$TGT" "$tmp/bpe" "$OUT/bin"
log "done: $OUT/bin"
