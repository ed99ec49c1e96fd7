# shellcheck shell=bash
# Steps shared by the preparation recipes. Every step writes to a temporary
# file and renames it when complete, and is skipped when its output exists,
# so an interrupted run resumes and never leaves a half-written file behind.

WORKERS=${WORKERS:-$(nproc 2>/dev/null || echo 2)}
# workers_for FILE...: the processes a step over the FILEs (lines in all) runs
# in: one below 20,000 lines, where starting a pool costs more than it saves
# (sacremoses on 3,000 lines: 0.8 s in one process, 1.7 s in two; at 26,000
# lines the pool gains under 5%, as it does in fairseq-preprocess), else WORKERS
workers_for() {
  local lines
  lines=$(cat -- "$@" 2>/dev/null | wc -l || true)  # a missing file counts for nothing
  if (( lines < 20000 )); then echo 1; else echo "$WORKERS"; fi
}
# whole (a signal ends every process of the preparation and removes its
# temporary files), temporary and tied
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/lib.sh"

# die MESSAGE: one line, and exit; a full file system under OUT is named, as a
# failed step's own message (or its empty log) may not say so
die() { echo "$(basename "$0"): error: $*$(full_disk "${OUT:-}")" >&2; exit 1; }
full_disk() {
  local avail
  [[ -n "$1" && -d "$1" ]] || return 0
  avail=$(df -Pk -- "$1" 2>/dev/null | awk 'NR == 2 {print $4}')
  if [[ "$avail" =~ ^[0-9]+$ ]] && (( avail < 1024 )); then
    echo " (No space left on device: the file system of $1 is full)"
  fi
}
log() { echo "[$(date +%H:%M:%S)] $*" >&2; }

# subword_usage WIDTH: the usage lines of --bpe, --bpe-size and --force,
# their descriptions from column WIDTH (the translation recipes')
subword_usage() {
  local w=$(($1 - 2))
  set -- "--bpe METHOD" "subword-nmt | sentencepiece (default: $BPE); a sentencepiece" \
    "" "model is saved as DIR/bin/$SPM_MODEL, beside the data" \
    "--bpe-size N" "subword-nmt merges, or the sentencepiece vocabulary size" "" "(default: $BPE_SIZE)" \
    "--force" "prepare again even if DIR is complete"
  while [[ $# -gt 0 ]]; do printf '  %-*s%s\n' "$w" "$1" "$2"; shift 2; done
}

# hold OUT FORCE: an flock on OUT/.powernorm-prep.lock for the rest of the
# script, so that a second preparation into OUT (which would rename the first's
# temporary files) is refused in one line; with FORCE non-empty, OUT is then
# emptied, the lock excepted. The lock is opened only if it is a regular file,
# never through a link.
hold() {
  local out=$1 lock="$1/.powernorm-prep.lock"
  mkdir -p "$out" || die "--out: cannot make '$out'"
  [[ ! -L "$lock" && ( ! -e "$lock" || -f "$lock" ) ]] \
    || die "--out: $lock is not a regular file; remove it"
  exec 9<>"$lock" || die "--out: cannot write in '$out'"
  flock -n 9 || die "--out: '$out' is being prepared by another run (pid $(head -c 16 "$lock")); wait for it to end, or pass another --out"
  echo "$$" > "$lock"
  [[ -z "$2" ]] || find "$out" -mindepth 1 -maxdepth 1 ! -name .powernorm-prep.lock -exec rm -rf -- {} +
}

# run_step OUTPUT COMMAND...: run COMMAND with stdout to OUTPUT.tmp, then rename
run_step() {
  local out=$1; shift
  [[ -s "$out" ]] && return 0
  temporary "$out.tmp"
  tied "$@" > "$out.tmp" || { rm -f "$out.tmp"; die "step failed: $*"; }
  mv "$out.tmp" "$out"
}

# utf8_clean IN OUT: IN with every invalid UTF-8 byte replaced by U+FFFD, and a
# warning with the number of such lines (raw corpora carry a few; one bad byte
# should neither stop a preparation nor silently change a line unreported)
utf8_clean() {
  temporary "$2.tmp"
  tied python - "$1" "$2" <<'PY' || die "reading $1 failed"
import os, sys
src, dst = sys.argv[1:]
bad = 0
with open(src, "rb") as f, open(dst + ".tmp", "w", encoding="utf-8") as out:
    for line in f:
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            text, bad = line.decode("utf-8", errors="replace"), bad + 1
        out.write(text)
os.replace(dst + ".tmp", dst)
if bad:
    print(f"warning: {src}: {bad} line(s) with invalid UTF-8, bytes replaced by U+FFFD", file=sys.stderr)
PY
}

# segments XML OUT: the text of each <seg ...> line of an IWSLT .xml or WMT .sgm
# file, untouched but for sacreBLEU's cleaning (the segment tags removed,
# whitespace stripped and collapsed: sacrebleu's fake-SGML rule), so that a
# reference made from it is the one sacreBLEU's own test sets hold
segments() {
  run_step "$2" python -c 'import re, sys
for line in open(sys.argv[1], encoding="utf-8"):
    if "<seg id" in line:
        print(re.sub(r"\s+", " ", re.sub(r"<seg.*?>(.*)</seg>.*?", r"\1", line.strip()).strip()))' "$1"
}

# apostrophes IN OUT: IN with ’ written as ', as fairseq's preparation scripts
# do before tokenizing a test set (the references sacreBLEU scores keep IN)
apostrophes() {
  run_step "$2" sed -e "s/’/'/g" "$1"
}

# tokenize LANG IN OUT [lowercase]: Moses tokenization (sacremoses, XML escaping
# as Moses' tokenizer.perl does by default), optionally lowercased
tokenize() {
  local lang=$1 in=$2 out=$3 lower=${4:-}
  [[ -s "$out" ]] && return 0
  utf8_clean "$in" "$out.utf8"
  local workers; workers=$(workers_for "$in")
  if [[ -n "$lower" ]]; then
    run_step "$out" bash -c 'sacremoses -q -l "$0" -j "$1" tokenize -x < "$2" | python -c "import sys
for line in sys.stdin: sys.stdout.write(line.lower())"' "$lang" "$workers" "$out.utf8"
  else
    run_step "$out" bash -c 'sacremoses -q -l "$0" -j "$1" tokenize -x < "$2"' "$lang" "$workers" "$out.utf8"
  fi
  rm -f "$out.utf8"
}

# The subword step every translation recipe shares: --bpe METHOD (subword-nmt
# or sentencepiece) and --bpe-size N (merges, or the sentencepiece vocabulary).
SUBWORD_METHODS="subword-nmt sentencepiece"
SPM_MODEL=spm.model  # the name of a sentencepiece model beside the binarized data

# prepared OUT METHOD: whether OUT/bin is complete (said in one line); one
# prepared with the other subword METHOD stops with what to do
prepared() {
  [[ -f "$1/bin/.done" ]] || return 1
  local had=subword-nmt
  [[ -f "$1/bin/$SPM_MODEL" ]] && had=sentencepiece
  [[ "$had" == "$2" ]] || die "$1 was prepared with --bpe $had; add --force to prepare it again with --bpe $2"
  log "$1 is already prepared (use --force to redo it)"
}

# subword_model DIR METHOD: where the recipes keep the subword model in DIR
subword_model() {
  if [[ "$2" == sentencepiece ]]; then echo "$1/$SPM_MODEL"; else echo "$1/bpe.codes"; fi
}

# check_subwords METHOD SIZE: one line naming the flag and what it takes
check_subwords() {
  [[ " $SUBWORD_METHODS " == *" $1 "* ]] || die "--bpe must be one of {${SUBWORD_METHODS// /,}}, got '$1'"
  [[ "$2" =~ ^[1-9][0-9]*$ ]] || die "--bpe-size must be a positive integer, got '$2'"
}

# learn_subwords METHOD SIZE MODEL TRAIN_SRC TRAIN_TGT: a joint subword model
# of both sides' tokenized training text. subword-nmt: BPE codes with SIZE
# merges on the concatenated text (fairseq's recipes). sentencepiece: a model
# with a vocabulary of SIZE (the package's default unigram algorithm), trained
# on the same tokenized text with identity normalization, so that decoding
# (fairseq's --post-process sentencepiece) gives back exactly the tokenized
# text the BLEU definitions score.
learn_subwords() {
  local method=$1 size=$2 model=$3 src=$4 tgt=$5
  [[ -s "$model" ]] && return 0
  run_step "$model.joint" cat "$src" "$tgt"
  if [[ "$method" == subword-nmt ]]; then
    # its progress bar (tqdm) only with VERBOSE: the stage already has its line
    local bar=(env TQDM_DISABLE=1)
    [[ -n "${VERBOSE:-}" ]] && bar=()
    run_step "$model" "${bar[@]+"${bar[@]}"}" subword-nmt learn-bpe -s "$size" --input "$model.joint"
  else
    temporary "$model.tmp"
    tied python - "$model" "$size" "$WORKERS" <<'PY' || die "learning the sentencepiece model failed"
import os, shutil, sys
import sentencepiece as spm
model, size, workers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
tmp = model + ".tmp"
os.mkdir(tmp)
try:
    spm.SentencePieceTrainer.train(
        input=model + ".joint", model_prefix=os.path.join(tmp, "spm"), vocab_size=size,
        hard_vocab_limit=False, character_coverage=1.0, normalization_rule_name="identity",
        input_sentence_size=2_000_000, shuffle_input_sentence=True, num_threads=workers,
        minloglevel=2)
    os.replace(os.path.join(tmp, "spm.vocab"), model + ".vocab")
    os.replace(os.path.join(tmp, "spm.model"), model)
finally:
    shutil.rmtree(tmp)
PY
  fi
  rm -f "$model.joint"
}

# apply_subwords METHOD MODEL IN OUT
apply_subwords() {
  local method=$1 model=$2 in=$3 out=$4
  if [[ "$method" == subword-nmt ]]; then
    run_step "$out" subword-nmt apply-bpe -c "$model" --num-workers "$(workers_for "$in")" --input "$in"
    return
  fi
  run_step "$out" python -c 'import sys
import sentencepiece as spm
sp = spm.SentencePieceProcessor(model_file=sys.argv[1])
with open(sys.argv[2], encoding="utf-8") as f:
    for line in f:
        print(" ".join(sp.encode(line.rstrip("\n"), out_type=str)))' "$model" "$in"
}

# clean_corpus IN SRC TGT MIN MAX RATIO OUT [lowercase]: the rules of Moses'
# clean-corpus-n.perl on IN.SRC/IN.TGT: whitespace normalised, both sides
# MIN-MAX words, neither side more than RATIO times the other; OUT.SRC/OUT.TGT
clean_corpus() {
  [[ -s "$7.$2" && -s "$7.$3" ]] && return 0
  temporary "$7.$2.tmp" "$7.$3.tmp"
  tied python - "$@" <<'PY' || die "cleaning $1 failed"
import os, sys
inp, src, tgt, lo, hi, ratio, out = sys.argv[1:8]
lower = len(sys.argv) > 8
lo, hi, ratio = int(lo), int(hi), float(ratio)
with open(f"{inp}.{src}", encoding="utf-8") as fs, open(f"{inp}.{tgt}", encoding="utf-8") as ft, \
        open(f"{out}.{src}.tmp", "w", encoding="utf-8") as os_, open(f"{out}.{tgt}.tmp", "w", encoding="utf-8") as ot:
    for s, t in zip(fs, ft, strict=True):
        s, t = " ".join(s.split()), " ".join(t.split())
        ns, nt = len(s.split()), len(t.split())
        if not (lo <= ns <= hi and lo <= nt <= hi) or ns / nt > ratio or nt / ns > ratio:
            continue
        os_.write((s.lower() if lower else s) + "\n")
        ot.write((t.lower() if lower else t) + "\n")
os.replace(f"{out}.{tgt}.tmp", f"{out}.{tgt}")
os.replace(f"{out}.{src}.tmp", f"{out}.{src}")
PY
}

# preprocess DEST ARGS...: fairseq-preprocess ARGS into DEST, which appears
# only when complete (DEST/.done); the files named in BESIDE (an array, may be
# unset) are copied into DEST with it. fairseq's log goes to
# DEST/../preprocess.log (VERBOSE=1: also to the console)
preprocess() {
  local dest=$1; shift
  [[ -f "$dest/.done" ]] && return 0
  temporary "$dest.tmp"
  local log; log="$(dirname "$dest")/preprocess.log"
  log "  fairseq-preprocess log: $log"
  local arg prev="" pref="" src="" tgt="" workers
  for arg in "$@"; do  # the training files: PREFIX.SRC and PREFIX.TGT, or PREFIX alone (--only-source)
    case "$prev" in --trainpref) pref=$arg ;; --source-lang) src=.$arg ;; --target-lang) tgt=.$arg ;; esac
    prev=$arg
  done
  if [[ -n "$src" ]]; then workers=$(workers_for "$pref$src" "$pref$tgt"); else workers=$(workers_for "$pref"); fi
  if [[ -n "${VERBOSE:-}" ]]; then
    tied fairseq-preprocess "$@" --destdir "$dest.tmp" --workers "$workers" 2>&1 | tied tee -a "$log" >&2
  else
    tied fairseq-preprocess "$@" --destdir "$dest.tmp" --workers "$workers" >> "$log" 2>&1
  fi || { rm -rf "$dest.tmp"; tail -n 5 "$log" >&2; die "fairseq-preprocess failed (log: $log)"; }
  local file
  for file in "${BESIDE[@]+"${BESIDE[@]}"}"; do
    cp "$file" "$dest.tmp/" || { rm -rf "$dest.tmp"; die "copying $file failed"; }
  done
  touch "$dest.tmp/.done"
  rm -rf "$dest"
  mv "$dest.tmp" "$dest"
}

# binarize SRC TGT PREFIX_DIR DEST: fairseq-preprocess with a joined dictionary
binarize() {
  local src=$1 tgt=$2 dir=$3 dest=$4
  preprocess "$dest" --source-lang "$src" --target-lang "$tgt" \
    --trainpref "$dir/train" --validpref "$dir/valid" --testpref "$dir/test" --joined-dictionary
}

# fetch URL PATH HINT: download URL to PATH unless PATH exists; HINT names the
# option that takes a local copy instead
fetch() {
  local url=$1 path=$2 hint=$3
  [[ -s "$path" ]] && return 0
  log "downloading $url"
  temporary "$path.tmp"
  tied curl -fL --retry 3 -o "$path.tmp" "$url" || { rm -f "$path.tmp"; die "download failed: $url (use $hint)"; }
  mv "$path.tmp" "$path"
}

# extract_member ARCHIVE NAME OUT: the member NAME of a .zip or .tar.gz (under
# any leading directory, e.g. ./NAME), written to OUT
extract_member() {
  [[ -s "$3" ]] && return 0
  local status=0
  temporary "$3.tmp"
  tied python - "$@" <<'PY' || status=$?
import os, shutil, sys, tarfile, zipfile
archive, name, out = sys.argv[1:]
wanted = lambda n: n == name or n.endswith("/" + name)
try:
    if zipfile.is_zipfile(archive):
        z = zipfile.ZipFile(archive)
        names = [n for n in z.namelist() if wanted(n)]
        opened = z.open(names[0]) if names else None
    else:
        t = tarfile.open(archive)
        names = [m for m in t.getmembers() if m.isfile() and wanted(m.name)]
        opened = t.extractfile(names[0]) if names else None
    if opened is None:
        sys.exit(3)
    with opened as src, open(out + ".tmp", "wb") as dst:
        shutil.copyfileobj(src, dst)
except (OSError, tarfile.TarError, zipfile.BadZipFile, EOFError):
    sys.exit(4)
os.replace(out + ".tmp", out)
PY
  rm -f "$3.tmp"
  case $status in
    0) ;;
    3) die "archive $1 has no member $2 (is it the right archive?)" ;;
    *) die "corrupt or unreadable archive: $1" ;;
  esac
}

# binarize_lm DIR DEST: fairseq-preprocess --only-source of DIR/{train,valid,test}.txt
binarize_lm() {
  local dir=$1 dest=$2
  preprocess "$dest" --only-source \
    --trainpref "$dir/train.txt" --validpref "$dir/valid.txt" --testpref "$dir/test.txt"
}

# joint_subwords DIR IN OUT: one subword model (BPE, BPE_SIZE; its file in
# MODEL) learned on the training text DIR/train$IN.{SRC,TGT} and applied to
# DIR/{train,valid,test}$IN.L, written to DIR/bpe/SPLIT$OUT.L
joint_subwords() {
  local dir=$1 in=$2 out=$3 l split
  log "learning joint subwords on the training text ($BPE, size $BPE_SIZE)"
  MODEL=$(subword_model "$dir" "$BPE")
  learn_subwords "$BPE" "$BPE_SIZE" "$MODEL" "$dir/train$in.$SRC" "$dir/train$in.$TGT"
  mkdir -p "$dir/bpe"
  for l in $SRC $TGT; do
    for split in train valid test; do
      apply_subwords "$BPE" "$MODEL" "$dir/$split$in.$l" "$dir/bpe/$split$out.$l"
    done
  done
}
