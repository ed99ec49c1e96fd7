# shellcheck shell=bash
# Steps shared by the preparation recipes. Every step writes to a temporary
# file and renames it when complete, and is skipped when its output exists,
# so an interrupted run resumes and never leaves a half-written file behind.

WORKERS=${WORKERS:-$(nproc 2>/dev/null || echo 2)}

die() { echo "$(basename "$0"): error: $*" >&2; exit 1; }
log() { echo "[$(date +%H:%M:%S)] $*" >&2; }

# run_step OUTPUT COMMAND...: run COMMAND with stdout to OUTPUT.tmp, then rename
run_step() {
  local out=$1; shift
  [[ -s "$out" ]] && return 0
  "$@" > "$out.tmp" || { rm -f "$out.tmp"; die "step failed: $*"; }
  mv "$out.tmp" "$out"
}

# utf8_clean IN OUT: IN with every invalid UTF-8 byte replaced by U+FFFD, and a
# warning with the number of such lines (raw corpora carry a few; one bad byte
# should neither stop a preparation nor silently change a line unreported)
utf8_clean() {
  python - "$1" "$2" <<'PY' || die "reading $1 failed"
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

# tokenize LANG IN OUT [lowercase]: Moses tokenization (sacremoses, XML escaping
# as Moses' tokenizer.perl does by default), optionally lowercased
tokenize() {
  local lang=$1 in=$2 out=$3 lower=${4:-}
  [[ -s "$out" ]] && return 0
  utf8_clean "$in" "$out.utf8"
  if [[ -n "$lower" ]]; then
    run_step "$out" bash -c 'sacremoses -q -l "$0" -j "$1" tokenize -x < "$2" | python -c "import sys
for line in sys.stdin: sys.stdout.write(line.lower())"' "$lang" "$WORKERS" "$out.utf8"
  else
    run_step "$out" bash -c 'sacremoses -q -l "$0" -j "$1" tokenize -x < "$2"' "$lang" "$WORKERS" "$out.utf8"
  fi
  rm -f "$out.utf8"
}

# learn_bpe MERGES CODES TRAIN_SRC TRAIN_TGT: joint BPE (subword-nmt)
learn_bpe() {
  local merges=$1 codes=$2 src=$3 tgt=$4
  [[ -s "$codes" ]] && return 0
  subword-nmt learn-joint-bpe-and-vocab --input "$src" "$tgt" -s "$merges" \
    -o "$codes.tmp" --write-vocabulary "$codes.vocab.src" "$codes.vocab.tgt" 2>/dev/null \
    || { rm -f "$codes.tmp"; die "learning BPE failed"; }
  mv "$codes.tmp" "$codes"
}

# apply_bpe CODES IN OUT
apply_bpe() {
  run_step "$3" subword-nmt apply-bpe -c "$1" --num-workers "$WORKERS" --input "$2"
}

# clean_corpus IN SRC TGT MIN MAX RATIO OUT [lowercase]: the rules of Moses'
# clean-corpus-n.perl on IN.SRC/IN.TGT: whitespace normalised, both sides
# MIN-MAX words, neither side more than RATIO times the other; OUT.SRC/OUT.TGT
clean_corpus() {
  [[ -s "$7.$2" && -s "$7.$3" ]] && return 0
  python - "$@" <<'PY' || die "cleaning $1 failed"
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
# only when complete (DEST/.done)
preprocess() {
  local dest=$1; shift
  [[ -f "$dest/.done" ]] && return 0
  rm -rf "$dest.tmp"
  fairseq-preprocess "$@" --destdir "$dest.tmp" --workers "$WORKERS" >&2 \
    || { rm -rf "$dest.tmp"; die "fairseq-preprocess failed"; }
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
  curl -fL --retry 3 -o "$path.tmp" "$url" || { rm -f "$path.tmp"; die "download failed: $url (use $hint)"; }
  mv "$path.tmp" "$path"
}

# extract_member ARCHIVE NAME OUT: the member NAME of a .zip or .tar.gz (under
# any leading directory, e.g. ./NAME), written to OUT
extract_member() {
  [[ -s "$3" ]] && return 0
  local status=0
  python - "$@" <<'PY' || status=$?
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
