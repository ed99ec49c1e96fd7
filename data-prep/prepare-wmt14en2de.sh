#!/usr/bin/env bash
# WMT14 English-German in the setup of Vaswani et al. (2017) that the PowerNorm
# paper uses: europarl-v7 + commoncrawl + news-commentary for training,
# newstest2013 as valid, newstest2014 as test, joint BPE. Moses steps through
# sacremoses, BPE through subword-nmt, binarized with fairseq-preprocess.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/lib.sh"
whole "$@"
environment  # fairseq and the tools, from .venv if no environment is active

BASE_URL="http://statmt.org/wmt13"
SRC=en TGT=de
# 40,000 joint merges: the count of fairseq's prepare-wmt14en2de.sh, whose
# output (a joined ~40k dictionary) the paper's authors trained on
BPE=subword-nmt BPE_SIZE=40000
CLEAN_RATIO=1.5 CLEAN_MIN=1 CLEAN_MAX=250
NC=v12  # news-commentary release: v12 as fairseq's script and the authors; v9 is WMT14's own
OUT=data-bin/wmt14 ARCHIVE_DIR="" FORCE=""

usage() {
  cat <<USAGE
usage: data-prep/prepare-wmt14en2de.sh [--archive-dir DIR] [--out DIR] [--news-commentary v9|v12]
                                       [--bpe METHOD] [--bpe-size N] [--force]

  --archive-dir DIR   local copies of training-parallel-europarl-v7.tgz,
                      training-parallel-commoncrawl.tgz, training-parallel-nc-<v>.tgz,
                      dev.tgz and test-full.tgz (default: download them)
  --out DIR           output directory (default: $OUT): DIR/bin binarized, DIR/raw
                      untokenized test references, DIR/tmp intermediate files
  --news-commentary V v12 (default; fairseq's script, the authors' data) or v9 (WMT14's release)
USAGE
  subword_usage 22
}

declare -A OPTIONS=([--archive-dir]=ARCHIVE_DIR [--out]=OUT [--news-commentary]=NC [--bpe]=BPE
                   [--bpe-size]=BPE_SIZE [--force]=FORCE=1)
parse_options "$@"
[[ "$NC" == v9 || "$NC" == v12 ]] || die "--news-commentary must be one of {v9,v12}, got '$NC'"

# archive -> members this recipe reads from it
declare -A NEEDS=(
  [training-parallel-europarl-v7.tgz]="training/europarl-v7.de-en.en training/europarl-v7.de-en.de"
  [training-parallel-commoncrawl.tgz]="commoncrawl.de-en.en commoncrawl.de-en.de"
  [training-parallel-nc-$NC.tgz]="training/news-commentary-$NC.de-en.en training/news-commentary-$NC.de-en.de"
  [dev.tgz]="dev/newstest2013.en dev/newstest2013.de"
  [test-full.tgz]="test-full/newstest2014-deen-src.en.sgm test-full/newstest2014-deen-ref.de.sgm"
)
declare -A URLS=(
  [training-parallel-europarl-v7.tgz]="$BASE_URL/training-parallel-europarl-v7.tgz"
  [training-parallel-commoncrawl.tgz]="$BASE_URL/training-parallel-commoncrawl.tgz"
  [training-parallel-nc-v9.tgz]="http://statmt.org/wmt14/training-parallel-nc-v9.tgz"
  [training-parallel-nc-v12.tgz]="http://data.statmt.org/wmt17/translation-task/training-parallel-nc-v12.tgz"
  [dev.tgz]="http://data.statmt.org/wmt17/translation-task/dev.tgz"
  [test-full.tgz]="http://statmt.org/wmt14/test-full.tgz"
)

check_subwords "$BPE" "$BPE_SIZE"
hold "$OUT" "$FORCE"
if [[ -z "$FORCE" ]] && prepared "$OUT" "$BPE"; then
  exit 0
fi
mkdir -p "$OUT/orig" "$OUT/tmp" "$OUT/raw"
orig="$OUT/orig" tmp="$OUT/tmp"

for archive in "${!NEEDS[@]}"; do
  path="${ARCHIVE_DIR:+$ARCHIVE_DIR/}$archive"
  if [[ -z "$ARCHIVE_DIR" ]]; then
    path="$orig/$archive"
    fetch "${URLS[$archive]}" "$path" "--archive-dir DIR"
  fi
  [[ -f "$path" ]] || die "missing archive: $path"
  members=$(tar tzf "$path" 2>/dev/null) || die "corrupt or unreadable archive: $path"
  for m in ${NEEDS[$archive]}; do
    grep -qx "$m" <<<"$members" || die "archive $path lacks $m"
  done
  if [[ ! -f "$orig/.extracted-$archive" ]]; then
    # shellcheck disable=SC2086
    tar xzf "$path" -C "$orig" ${NEEDS[$archive]} || die "corrupt archive: $path"
    touch "$orig/.extracted-$archive"
  fi
done

CORPORA=(training/europarl-v7.de-en commoncrawl.de-en "training/news-commentary-$NC.de-en")
log "training data: normalize punctuation, remove control characters, tokenize (aggressive dashes)"
for l in $SRC $TGT; do
  if [[ ! -s "$tmp/train.tok.$l" ]]; then
    for c in "${CORPORA[@]}"; do cat "$orig/$c.$l"; done \
      | sacremoses -q -l "$l" -j "$WORKERS" normalize -q -d -c \
      | sacremoses -q -l "$l" -j "$WORKERS" tokenize -a -x > "$tmp/train.tok.$l.tmp" \
      || { rm -f "$tmp/train.tok.$l.tmp"; die "tokenizing the $l training data failed"; }
    mv "$tmp/train.tok.$l.tmp" "$tmp/train.tok.$l"
  fi
done

log "valid = newstest2013, test = newstest2014"
for l in $SRC $TGT; do
  run_step "$OUT/raw/valid.$l" cat "$orig/dev/newstest2013.$l"
  t=$([[ "$l" == "$SRC" ]] && echo src || echo ref)
  segments "$orig/test-full/newstest2014-deen-$t.$l.sgm" "$OUT/raw/test.$l"
  apostrophes "$OUT/raw/test.$l" "$tmp/test.apos.$l"
  for input in "valid $OUT/raw/valid.$l" "test $tmp/test.apos.$l"; do
    read -r split file <<<"$input"
    run_step "$tmp/$split.tok.$l" bash -c \
      'sacremoses -q -l "$0" normalize -q -d -c < "$1" | sacremoses -q -l "$0" -j "$2" tokenize -a -x' \
      "$l" "$file" "$WORKERS"
  done
done
# the test reference is sacrebleu's own wmt14/full en-de when the archive is
# the one sacrebleu downloads (its md5): powernorm-score's signature then names it
test_archive="${ARCHIVE_DIR:+$ARCHIVE_DIR/}test-full.tgz"
[[ -n "$ARCHIVE_DIR" ]] || test_archive="$orig/test-full.tgz"
if [[ ! -e "$OUT/raw/test.$TGT.sacrebleu" ]] && python -c '
import hashlib, sys
from sacrebleu.dataset import DATASETS
sys.exit(hashlib.md5(open(sys.argv[1], "rb").read()).hexdigest() not in DATASETS["wmt14/full"].md5)' "$test_archive"; then
  echo "wmt14/full $SRC-$TGT" > "$OUT/raw/test.$TGT.sacrebleu"
fi

joint_subwords "$tmp" .tok .bpe
for l in $SRC $TGT; do
  run_step "$tmp/bpe/valid.$l" cat "$tmp/bpe/valid.bpe.$l"
  run_step "$tmp/bpe/test.$l" cat "$tmp/bpe/test.bpe.$l"
done

log "cleaning the training data: length $CLEAN_MIN-$CLEAN_MAX, ratio $CLEAN_RATIO (after BPE, as fairseq)"
clean_corpus "$tmp/bpe/train.bpe" "$SRC" "$TGT" "$CLEAN_MIN" "$CLEAN_MAX" "$CLEAN_RATIO" "$tmp/bpe/train"

log "binarizing (fairseq-preprocess --joined-dictionary)"
BESIDE=("$MODEL")
binarize "$SRC" "$TGT" "$tmp/bpe" "$OUT/bin"
log "done: $OUT/bin"
