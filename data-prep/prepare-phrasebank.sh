#!/usr/bin/env bash
# Sentence classification data for fairseq's sentence_prediction task from
# Financial PhraseBank (Malo et al., 2014) or any text<TAB>label file:
# shuffle and split with a seed, Moses-tokenize, learn subwords on the
# training split only, and binarize into DIR/bin/input0 and DIR/bin/label.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/lib.sh"
whole "$@"
environment  # fairseq and the tools, from .venv if no environment is active

SRC=""
DEMO=""
OUT=data-bin/phrasebank
FORMAT=auto
ENCODING=auto
VALID=0.2
TEST=0
SEED=1
BPE=subword-nmt
BPE_SIZE=2000
SKIP=""
FORCE=""
HEADER=""
FOLD=""

usage() {
  cat <<USAGE
usage: data-prep/prepare-phrasebank.sh (--src FILE | --demo N) [--out DIR] [options]

  --src FILE            Financial PhraseBank's Sentences_AllAgree.txt (or the
                        50/66/75 files): one 'sentence@label' per line, split at
                        the last '@', labels negative, neutral, positive; or
                        any 'text<TAB>label' file
  --demo N              instead of --src: N sentences written from templates
                        whose labels are true of their text (not PhraseBank;
                        data-prep/sentiment_demo.py, docs/study.md)
  --out DIR             where to write (default: $OUT); the binarized data goes
                        to DIR/bin, the split text to DIR/raw
  --format F            auto | phrasebank | tsv (default: auto: tsv if the
                        first line holds a tab)
  --encoding E          the file's encoding (default: auto: UTF-8 if it reads
                        as UTF-8, else ISO-8859-1, PhraseBank's)
  --valid-fraction F    share of the sentences for valid (default: $VALID)
  --test-fraction F     share for a test split (default: $TEST, no test split)
  --seed N              the shuffle's seed (default: $SEED)
  --bpe METHOD          subword-nmt | sentencepiece (default: $BPE), learned on
                        the training split only
  --bpe-size N          merges, or the sentencepiece vocabulary (default: $BPE_SIZE)
  --skip-malformed      drop malformed lines (counted and named) instead of
                        stopping: a line without its label, or a TSV line
                        without exactly two columns
  --header              the first line is a header (column names): skip it
  --fold-case           labels that differ only in case are one label, in
                        lower case (without it: a warning names them)
  --force               redo everything even if DIR is already prepared (from
                        another --src or with other options, too)
USAGE
}

declare -A OPTIONS=([--src]=SRC [--demo]=DEMO [--out]=OUT [--format]=FORMAT [--encoding]=ENCODING
                   [--valid-fraction]=VALID [--test-fraction]=TEST [--seed]=SEED [--bpe]=BPE
                   [--bpe-size]=BPE_SIZE [--bpe-merges]=BPE_SIZE [--skip-malformed]=SKIP=1 [--force]=FORCE=1
                   [--header]=HEADER=1 [--fold-case]=FOLD=1)
parse_options "$@"
[[ -n "$SRC" || -n "$DEMO" ]] || { usage >&2; die "give --src FILE or --demo N"; }
[[ -z "$SRC" || -z "$DEMO" ]] || die "--src and --demo exclude each other: give one"
[[ -z "$SRC" || -f "$SRC" ]] || die "--src: no such file '$SRC'"
[[ -z "$DEMO" || "$DEMO" =~ ^[1-9][0-9]*$ ]] || die "--demo must be a positive integer, got '$DEMO'"
[[ "$FORMAT" =~ ^(auto|phrasebank|tsv)$ ]] || die "--format must be one of {auto,phrasebank,tsv}, got '$FORMAT'"
[[ "$SEED" =~ ^[0-9]+$ ]] || die "--seed must be a non-negative integer, got '$SEED'"
for pair in "--valid-fraction:$VALID" "--test-fraction:$TEST"; do
  python -c 'import sys; f = float(sys.argv[1]); sys.exit(not 0 <= f < 1)' "${pair#*:}" 2>/dev/null \
    || die "${pair%%:*} must be a number in [0, 1), got '${pair#*:}'"
done
python -c 'import sys; sys.exit(not 0 < float(sys.argv[1]) < 1)' "$VALID" || die "--valid-fraction must be in (0, 1), got '$VALID'"
python -c 'import codecs, sys; sys.argv[1] == "auto" or codecs.lookup(sys.argv[1])' "$ENCODING" 2>/dev/null \
  || die "--encoding: unknown encoding '$ENCODING' (e.g. utf-8, iso-8859-1, or auto)"
check_subwords "$BPE" "$BPE_SIZE"

hold "$OUT" "$FORCE"
# what OUT is prepared from: another source or other options into it are refused, never mixed or skipped
if [[ -n "$DEMO" ]]; then
  FROM="demo $DEMO"
else
  FROM="$(sha256sum < "$SRC" | cut -d' ' -f1) of $SRC"
fi
SETTINGS="format $FORMAT, encoding $ENCODING, valid $VALID, test $TEST, seed $SEED, skip-malformed ${SKIP:-0}, header ${HEADER:-0}, fold-case ${FOLD:-0}, bpe $BPE $BPE_SIZE"
if [[ -f "$OUT/source.txt" ]]; then
  had=$(head -n 1 "$OUT/source.txt"); had_settings=$(sed -n 2p "$OUT/source.txt")
  [[ "${had%% of *}" == "${FROM%% of *}" && "$had_settings" == "$SETTINGS" ]] \
    || die "--out $OUT holds data prepared from ${had#* of } ($had_settings), not from ${FROM#* of } ($SETTINGS); pass --force to prepare it again, or another --out"
fi
if [[ -z "$FORCE" ]] && prepared "$OUT" "$BPE"; then
  exit 0
fi
mkdir -p "$OUT/tmp" "$OUT/raw"

if [[ -n "$DEMO" ]]; then
  log "writing $DEMO demo sentences (data-prep/sentiment_demo.py, seed $SEED)"
  run_step "$OUT/tmp/demo.tsv" python "$HERE/sentiment_demo.py" "$DEMO" "$SEED"
  SRC="$OUT/tmp/demo.tsv" FORMAT=tsv
fi

log "reading $SRC and splitting it (seed $SEED, valid $VALID, test $TEST)"
if [[ ! -s "$OUT/raw/train.label" ]]; then
  temporary "$OUT/raw.tmp"
  rm -rf "$OUT/raw.tmp" && mkdir -p "$OUT/raw.tmp"
  tied python - "$SRC" "$FORMAT" "$ENCODING" "$VALID" "$TEST" "$SEED" "$SKIP" "$OUT/raw.tmp" "$HEADER" "$FOLD" <<'PY' || { [[ $? == 3 ]] && exit 2; die "reading $SRC failed"; }
import collections, os, random, sys
src, fmt, encoding, valid, test, seed, skip, out, header, fold = sys.argv[1:]


def refuse(message):
    print(f"prepare-phrasebank.sh: error: {message}", file=sys.stderr)
    sys.exit(3)


raw = open(src, "rb").read()
if encoding == "auto":
    try:
        raw.decode("utf-8")
        encoding = "utf-8"
    except UnicodeDecodeError:
        encoding = "iso-8859-1"
text = raw.decode(encoding, errors="strict").removeprefix("\ufeff")  # a byte-order mark is no text
# lines end at a newline only (CR LF too): U+2028, U+0085 and the like are characters of a sentence
lines = [line.removesuffix("\r") for line in text.split("\n")]
if lines and lines[-1] == "":
    lines.pop()
numbered = [(n, line) for n, line in enumerate(lines, 1)]
first = next(((n, line) for n, line in numbered if line.strip()), (0, ""))
if fmt == "auto":
    fmt = "tsv" if "\t" in first[1] else "phrasebank"
sep = "\t" if fmt == "tsv" else "@"
if header:
    numbered = [(n, line) for n, line in numbered if n != first[0]]
PHRASEBANK = {"negative", "neutral", "positive"}
rows, bad, blank, seen, duplicates = [], [], 0, set(), 0
for number, line in numbered:
    if not line.strip():
        blank += 1
        continue
    sentence, found, label = line.rpartition(sep)
    sentence, label = " ".join(sentence.split()), label.strip()
    if fold:
        label = label.lower()
    if fmt == "tsv" and line.count("\t") > 1:
        bad.append((number, f"{line.count(chr(9)) + 1} columns, not 2 (text<TAB>label)"))
    elif not found or not sentence or not label or " " in label:
        bad.append((number, f"no '{'<TAB>' if sep == chr(9) else '@'}label' at its end"))
    elif fmt == "phrasebank" and label not in PHRASEBANK:
        bad.append((number, f"label {label!r} is not one of negative, neutral, positive"))
    elif (sentence, label) in seen:
        duplicates += 1
    else:
        seen.add((sentence, label))
        rows.append((sentence, label))
if bad:
    where = ", ".join(f"{src}:{n} ({why})" for n, why in bad[:3])
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    if not skip:
        refuse(f"{len(bad)} malformed line(s) in {src} ({fmt}, {encoding}): {where}{more}; "
                 "fix them, or pass --skip-malformed to drop them")
    print(f"warning: dropped {len(bad)} malformed line(s): {where}{more}", file=sys.stderr)
labels = collections.Counter(label for _, label in rows)
if not header and first[0] and fmt == "tsv":  # a header: one word naming each column, its "label" nowhere else
    name, _, top = first[1].rpartition(sep)
    top = top.strip().lower() if fold else top.strip()
    if labels.get(top) == 1 and len(rows) > 2 and len(name.split()) == 1:
        refuse(f"{src}:{first[0]} looks like a header (one word, and its label {top!r} is on no other line): "
                 "pass --header to skip it, or remove it")
spellings = collections.defaultdict(set)
for label in labels:
    spellings[label.lower()].add(label)
variants = sorted(sorted(group) for group in spellings.values() if len(group) > 1)
if variants:
    print(f"warning: labels that differ only in case are separate classes: "
          f"{'; '.join(' / '.join(g) for g in variants)} (--fold-case makes each one label)", file=sys.stderr)
if len(labels) < 2:
    refuse(f"{src} holds {len(labels)} label(s) ({', '.join(labels) or 'none'}): a classifier needs two or more")
random.Random(int(seed)).shuffle(rows)
n_valid, n_test = round(len(rows) * float(valid)), round(len(rows) * float(test))
splits = {"valid": rows[:n_valid], "test": rows[n_valid:n_valid + n_test], "train": rows[n_valid + n_test:]}
if not splits["train"] or not splits["valid"]:
    refuse(f"{len(rows)} sentences leave an empty train or valid split; give more, or other fractions")
in_train = collections.Counter(label for _, label in splits["train"])
missing = sorted(label for label in labels if not in_train[label])
if missing:  # fairseq's label dictionary is the training split's: another label could not be a target
    refuse(f"label {missing[0]!r} ({labels[missing[0]]} sentence(s)) falls in no training sentence"
             f"{f' (nor {len(missing) - 1} more label(s))' if len(missing) > 1 else ''}; give more sentences "
             "of it, another --seed or --valid-fraction, or remove it")
for split, part in splits.items():
    if not part:
        continue
    with open(os.path.join(out, f"{split}.txt"), "w", encoding="utf-8") as ft, \
            open(os.path.join(out, f"{split}.label"), "w", encoding="utf-8") as fl:
        for sentence, label in part:
            ft.write(sentence + "\n")
            fl.write(label + "\n")
counts = ", ".join(f"{label} {n}" for label, n in sorted(labels.items()))
print(f"{len(rows)} sentences ({fmt}, {encoding}; {counts}); skipped {blank} blank line(s), "
      f"{duplicates} exact duplicate(s); train {len(splits['train'])}, valid {len(splits['valid'])}, "
      f"test {len(splits['test'])}", file=sys.stderr)
PY
  cp -f "$OUT/raw.tmp"/* "$OUT/raw/"
  rm -rf "$OUT/raw.tmp"
  printf '%s\n%s\n' "$FROM" "$SETTINGS" > "$OUT/source.txt"  # once the sentences are read: a refusal binds nothing
fi
SPLITS=(train valid)
[[ -s "$OUT/raw/test.txt" ]] && SPLITS+=(test)

log "tokenizing (sacremoses)"
for split in "${SPLITS[@]}"; do
  tokenize en "$OUT/raw/$split.txt" "$OUT/tmp/$split.tok"
done
log "learning subwords on the training split ($BPE, size $BPE_SIZE)"
MODEL=$(subword_model "$OUT/tmp" "$BPE")
learn_subwords "$BPE" "$BPE_SIZE" "$MODEL" "$OUT/tmp/train.tok" /dev/null
for split in "${SPLITS[@]}"; do
  apply_subwords "$BPE" "$MODEL" "$OUT/tmp/$split.tok" "$OUT/tmp/$split.input0"
done

log "binarizing (fairseq-preprocess --only-source: input0 and label)"
prefixes() {  # --trainpref etc. of the splits there are, for files ending in $1
  local split; for split in "${SPLITS[@]}"; do echo "--${split}pref" "$OUT/tmp/$split$1"; done
}
for split in "${SPLITS[@]}"; do run_step "$OUT/tmp/$split.label" cat "$OUT/raw/$split.label"; done
BESIDE=("$MODEL")
# shellcheck disable=SC2046
preprocess "$OUT/tmp/bin-input0" --only-source $(prefixes .input0)
BESIDE=()
# shellcheck disable=SC2046
preprocess "$OUT/tmp/bin-label" --only-source --padding-factor 1 $(prefixes .label)
temporary "$OUT/bin.tmp"
rm -rf "$OUT/bin.tmp" && mkdir -p "$OUT/bin.tmp"
cp -r "$OUT/tmp/bin-input0" "$OUT/bin.tmp/input0"
cp -r "$OUT/tmp/bin-label" "$OUT/bin.tmp/label"
mv "$OUT/bin.tmp/input0/$(basename "$MODEL")" "$OUT/bin.tmp/"
touch "$OUT/bin.tmp/.done"
rm -rf "$OUT/bin"
mv "$OUT/bin.tmp" "$OUT/bin"
log "done: $OUT/bin ($(wc -l < "$OUT/bin/label/dict.txt") classes; train with --task sentence_prediction --num-classes $(wc -l < "$OUT/bin/label/dict.txt"))"
