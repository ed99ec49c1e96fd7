# shellcheck shell=bash
# What the scripts share. The caller defines die() and usage() and sets the
# variables each function names.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"  # the checkout

# whole ARGS...: the first thing a script does: it runs again under
# scripts/tree.py, which on a SIGTERM or SIGHUP (a scheduler's preemption,
# `timeout`, a closed terminal) ends every process the script started, at any
# depth, and removes the files it named with `temporary`. Nested scripts run
# under their caller's.
_TREE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/tree.py"
whole() {
  [[ -n "${POWERNORM_TREE:-}" ]] || exec python3 "$_TREE" bash "$0" "$@"
}

# environment: the tools the recipes run (fairseq's commands, sacremoses, the
# plugin's), from the environment in use, else from the checkout's .venv
# (scripts/setup.sh), activated here; without either, one line saying how to
# make one, before anything is written
environment() {
  local tool
  _tools() {
    for tool in python fairseq-train fairseq-preprocess sacremoses powernorm-average; do
      command -v "$tool" >/dev/null || return 1
    done
  }
  _tools && python -c 'import powernorm_fairseq' 2>/dev/null && return 0
  if [[ -f "$ROOT/.venv/bin/activate" ]]; then
    # shellcheck source=/dev/null
    source "$ROOT/.venv/bin/activate"
    _tools && return 0
  fi
  echo "$(basename "$0"): error: no environment with fairseq and this plugin (no $tool here, nor a complete" \
       "$ROOT/.venv): run 'bash $ROOT/scripts/setup.sh', which makes .venv in the checkout" >&2
  exit 2
}

# temporary PATH...: files or directories that a step is about to write and
# rename when complete: whatever an earlier run left there (a link included,
# never followed) is removed now, and they are removed if the script is ended
# before it renames them
temporary() {
  rm -rf -- "$@"
  [[ -z "${POWERNORM_TREE:-}" ]] || realpath -ms -- "$@" >> "$POWERNORM_TREE"  # -s: a link named, not its target
}

# writable DIR: whether a file can be made in DIR (test -w answers yes for
# root on a read-only bind mount of some kernels; making one does not lie)
writable() {
  local probe
  probe=$(mktemp -p "$1" .powernorm-write-test.XXXXXX 2>/dev/null) || return 1
  rm -f -- "$probe"
}

# fresh PATH...: refuse a symbolic link at a path the script writes (a log it
# appends to, an output it replaces): nothing is written through a link
fresh() {
  local path
  for path in "$@"; do
    [[ ! -L "$path" ]] || die "$path is a symbolic link; remove it (nothing is written through a link)"
  done
}

# tied CMD...: run CMD so that it ends when this script ends. Ctrl-C reaches
# the whole process group anyway; a SIGTERM (a scheduler's preemption,
# `timeout`) reaches only the script, which dies at once, and its children then
# get SIGTERM from the kernel (setpriv --pdeathsig; util-linux, present on any
# Linux: without it, CMD runs untied).
tied() {
  if ! command -v setpriv >/dev/null; then
    "$@"
  elif [[ "$BASHPID" != "$$" ]]; then  # a pipeline's subshell: become CMD, a child of the script itself
    exec setpriv --pdeathsig TERM -- "$@"
  else
    setpriv --pdeathsig TERM -- "$@"
  fi
}

# read_config ARGS...: source the file that follows --config in ARGS, if any, so
# that the options given on the command line, parsed afterwards, win over it
read_config() {
  local args=("$@") i cfg
  for ((i = 0; i < ${#args[@]}; i++)); do
    if [[ "${args[i]}" == "--config" ]]; then
      cfg="${args[i+1]:-}"
      [[ -f "$cfg" ]] || die "--config: no such file '$cfg'"
      # shellcheck source=/dev/null
      source "$cfg"
    fi
  done
}

# nearest WORD OPTION...: "; did you mean OPTION?" for the option nearest WORD (difflib's), or nothing
nearest() {
  python3 -c 'import difflib, sys
close = difflib.get_close_matches(sys.argv[1], [o for o in sys.argv[2:] if o.startswith("--")], 1, 0.75)
print(f"; did you mean {close[0]}?" if close else "", end="")' "$@"
}

# parse_options ARGS...: a script's options as OPTIONS, an associative array
# the caller declares, maps them: `[--out]=OUT` takes a value into OUT,
# `[--force]=FORCE=1` is a switch that sets FORCE to 1, and `[--]=EXTRA` keeps
# what follows -- in the array EXTRA; -h/--help prints the usage. An unknown
# option, or one without its value, stops the script with one line.
parse_options() {
  local spec
  while [[ $# -gt 0 ]]; do
    [[ "$1" != -h && "$1" != --help ]] || { usage; exit 0; }
    [[ -n "${OPTIONS[$1]+set}" ]] || die "unknown option '$1'$(nearest "$1" "${!OPTIONS[@]}") (see --help)"
    spec="${OPTIONS[$1]}"
    if [[ "$1" == -- ]]; then
      shift; eval "$spec+=(\"\$@\")"; break
    elif [[ "$spec" == *=* ]]; then
      printf -v "${spec%%=*}" '%s' "${spec#*=}"; shift
    else
      [[ $# -ge 2 ]] || die "$1 needs a value"
      printf -v "$spec" '%s' "$2"; shift 2
    fi
  done
}

# parse_run_options ARGS...: the options both training scripts take (see their
# usage), into DATASET, DATA, NORM, PLACEMENT, QK_NORM, SEED, GPUS, WORLD_SIZE,
# UPDATE_FREQ, TOKENS_PER_UPDATE, SAVE_DIR, DRY_RUN and EXTRA (what follows --), and --verbose into VERBOSE;
# OPTIONS, which the caller declares, adds its own (parse_options)
parse_run_options() {
  OPTIONS+=([--config]=_CONFIG [--dataset]=DATASET [--data]=DATA [--norm]=NORM [--placement]=PLACEMENT
            [--qk-norm]=QK_NORM [--seed]=SEED [--gpus]=GPUS [--world-size]=WORLD_SIZE
            [--update-freq]=UPDATE_FREQ [--tokens-per-update]=TOKENS_PER_UPDATE [--save-dir]=SAVE_DIR [--dry-run]=DRY_RUN=1 [--verbose]=VERBOSE=1
            [--]=EXTRA)
  parse_options "$@"
  export VERBOSE
}

# registry: the plugin's norms, placements and QK-norm kinds into NORM_TYPES,
# PLACEMENTS and QK_KINDS, read once (importing the plugin loads torch and
# fairseq), or taken from POWERNORM_REGISTRY, where a caller that has read
# them already (scripts/reproduce.sh) passes them on: three lines, as printed here
registry() {
  if [[ -z "${POWERNORM_REGISTRY:-}" ]]; then
    POWERNORM_REGISTRY=$(python -c "from powernorm_fairseq.norms import NORM_TYPES; from powernorm_fairseq.norms.placement import PLACEMENTS; from powernorm_fairseq.norms.qk_norm import QK_KINDS; print(*NORM_TYPES); print(*PLACEMENTS); print(*QK_KINDS)" \
      2>/dev/null) || die "cannot import powernorm_fairseq (run scripts/setup.sh and activate .venv)"
  fi
  { read -r NORM_TYPES; read -r PLACEMENTS; read -r QK_KINDS; } <<<"$POWERNORM_REGISTRY"
}

# one_of FLAG VALUE LIST: VALUE is a word of LIST
one_of() {
  [[ " $3 " == *" $2 "* ]] || die "$1 must be one of {${3// /,}}, got '$2'"
}

# check_norm FLAG KIND: KIND is a norm of the plugin's registry
check_norm() {
  registry
  one_of "$1" "$2" "$NORM_TYPES"
}

# check_run: PLACEMENT, QK_NORM and SEED, which both training scripts take
check_run() {
  registry
  one_of --placement "$PLACEMENT" "$PLACEMENTS"
  [[ -z "$QK_NORM" ]] || one_of --qk-norm "$QK_NORM" "$QK_KINDS"
  [[ "$SEED" =~ ^[0-9]+$ ]] || die "--seed must be a non-negative integer, got '$SEED'"
}

# devices TOTAL_TOKENS MAX_TOKENS: from GPUS (empty = all visible), WORLD_SIZE
# (empty = a worker per GPU here; else the workers of a run that spans
# machines, each started apart, e.g. by SLURM), UPDATE_FREQ (empty = the
# fewest batches that keep each under MAX_TOKENS) and a `--max-tokens` or
# `--update-freq` among EXTRA (the flags after --), sets WORKERS, MAX_TOKENS
# (per worker), UPDATE_FREQ and DEVICE, the fairseq flags for the CPU or the
# GPUs, so that WORKERS x MAX_TOKENS x UPDATE_FREQ = TOTAL_TOKENS, the row's
# batch per update, for every number of workers; a number that cannot divide it
# is refused. More than one worker synchronises the norms' batch statistics
# over all of them (--norm-sync batch).
devices() {
  local total=${TOKENS_PER_UPDATE:-$1} max=$2 i rest=() per given=""
  if [[ -z "$GPUS" ]]; then
    GPUS=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  fi
  [[ "$GPUS" =~ ^[0-9]+$ ]] || die "--gpus must be a non-negative integer, got '$GPUS'"
  WORKERS=$(( GPUS > 0 ? GPUS : 1 ))
  if [[ -n "$WORLD_SIZE" ]]; then
    [[ "$WORLD_SIZE" =~ ^[1-9][0-9]*$ ]] || die "--world-size must be a positive integer, got '$WORLD_SIZE'"
    WORKERS=$WORLD_SIZE
  fi
  # after --, --max-tokens caps each worker's batch (the update frequency then keeps the row's batch);
  # --update-freq is this script's own option
  for ((i = 0; i < ${#EXTRA[@]}; i++)); do
    case "${EXTRA[i]}" in
      --max-tokens) max="${EXTRA[i+1]:-}" given=1; i=$((i + 1)) ;;
      --max-tokens=*) max="${EXTRA[i]#*=}" given=1 ;;
      --update-freq|--update-freq=*)
        die "--update-freq after --: give it as this script's --update-freq N, which keeps the row's $total tokens per update" ;;
      *) rest+=("${EXTRA[i]}") ;;
    esac
  done
  EXTRA=("${rest[@]+"${rest[@]}"}")
  [[ "$max" =~ ^[1-9][0-9]*$ ]] || die "--max-tokens must be a positive integer, got '$max'"
  [[ "$total" =~ ^[1-9][0-9]*$ ]] || die "--tokens-per-update must be a positive integer, got '$total'"
  (( total % WORKERS == 0 )) || die "$WORKERS workers (--gpus/--world-size) cannot divide the row's $total tokens per update; use a number of workers that divides $total"
  per=$(( total / WORKERS ))
  if [[ -n "$UPDATE_FREQ" ]]; then
    [[ "$UPDATE_FREQ" =~ ^[1-9][0-9]*$ ]] || die "--update-freq must be a positive integer, got '$UPDATE_FREQ'"
    (( per % UPDATE_FREQ == 0 )) || die "--update-freq $UPDATE_FREQ cannot divide the $per tokens each of $WORKERS worker(s) takes per update (the row's $total); use a divisor of $per"
    [[ -z "$given" ]] || (( max * UPDATE_FREQ == per )) || die "--max-tokens $max x --update-freq $UPDATE_FREQ x $WORKERS worker(s) is not the row's $total tokens per update; give one of them"
  else
    (( max <= per )) || max=$per
    UPDATE_FREQ=$(( (per + max - 1) / max ))
    while (( per % UPDATE_FREQ )); do UPDATE_FREQ=$(( UPDATE_FREQ + 1 )); done
  fi
  MAX_TOKENS=$(( per / UPDATE_FREQ ))
  TOKENS_PER_UPDATE=$(( WORKERS * MAX_TOKENS * UPDATE_FREQ ))
  DEVICE=()
  [[ "$GPUS" == 0 ]] && DEVICE=(--cpu)
  (( WORKERS > 1 )) && DEVICE+=(--distributed-world-size "$WORKERS" --norm-sync batch)
  return 0
}

# launch SUMMARY CMD...: print CMD with --dry-run (DRY_RUN set); else run it,
# its whole output in SAVE_DIR/train.log and the command in SAVE_DIR/command.txt,
# both written once the run is accepted: a run refused before it trains (a busy
# --save-dir, a bad flag) writes nothing there and shows its one error line
launch() {
  local summary=$1; shift
  if [[ -n "$DRY_RUN" ]]; then
    printf '%q ' "$@"; echo
    return 0
  fi
  local made=""
  [[ -d "$SAVE_DIR" ]] || made="$SAVE_DIR"
  mkdir -p "$SAVE_DIR"
  HEADER="$summary, $(batch_line) -> $SAVE_DIR"
  echo "$HEADER" >&2
  echo "  log: $SAVE_DIR/train.log" >&2
  COMMAND_FILE="$SAVE_DIR/command.txt" COMMAND_TEXT="$(printf '%q ' "$@")" MADE_DIR="$made" \
    logged "$SAVE_DIR/train.log" "$@"
}

# batch_line: the effective batch, as train.log's first line and the console state it
batch_line() {
  echo "world size $WORKERS, $WORKERS worker(s) x $MAX_TOKENS tokens x update-freq $UPDATE_FREQ = $TOKENS_PER_UPDATE tokens per update"
}

# logged LOG CMD...: run CMD, its output and errors appended to LOG; the
# console gets one line per epoch and the plugin's own messages (VERBOSE=1:
# the whole stream, as fairseq prints it). A failure shows its error line, or
# the end of LOG, and LOG's path
logged() {
  local log=$1 status=0; shift
  if [[ -n "${VERBOSE:-}" ]]; then
    [[ -z "${COMMAND_FILE:-}" ]] || echo "$COMMAND_TEXT" > "$COMMAND_FILE"
    [[ -z "${HEADER:-}" ]] || echo "$HEADER" >> "$log"
    tied "$@" 2>&1 | tee -a "$log"
    return
  fi
  local codes
  tied "$@" 2>&1 | tied python -m powernorm_fairseq.cli.progress --log "$log" --prefix "  " \
    ${COMMAND_FILE:+--command-file "$COMMAND_FILE" --command "$COMMAND_TEXT"} ${HEADER:+--header "$HEADER"} \
    ${MADE_DIR:+--remove-if-empty "$MADE_DIR"} && codes=(0 0) || codes=("${PIPESTATUS[@]}")
  status=${codes[0]}
  (( ${codes[1]} == 3 )) && return "$(( status ? status : 2 ))"  # refused: its error line is shown, nothing written
  (( status == 0 )) && return 0
  local last; last=$(tail -n 1 "$log")
  if [[ "$last" == *": error: "* ]]; then
    echo "$last" >&2
  else
    echo "$(basename "$1") failed (exit status $status); the end of $log:" >&2
    tail -n 20 "$log" | sed 's/^/  /' >&2
  fi
  return "$status"
}
