#!/usr/bin/env bash
# Train a language model of the PowerNorm paper's experiments (PTB, WikiText-103)
# with powernorm_transformer_lm: fairseq's transformer_lm with every norm set by
# --norm. The paper used a Tensorized Transformer (Ma et al., 2019); this recipe
# uses fairseq's own transformer LM recipe instead (see README, "Language modeling").
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # ROOT
whole "$@"
environment  # fairseq and the tools, from .venv if no environment is active

usage() {
  cat <<USAGE
usage: scripts/train-lm.sh [--config FILE] [--dataset NAME] [--norm KIND] [options] [-- FAIRSEQ_FLAGS...]

  --config FILE        a row from configs/lm-*.sh (sets DATASET, NORM, PLACEMENT, EXTRA)
  --dataset NAME       ptb | wikitext103 (default: ptb)
  --data DIR           binarized data (default: data-bin/<dataset>/bin)
  --norm KIND          every norm of the model: ln | bn | pn | pn-v | bn-original |
                       scalenorm | rmsnorm | ... (see --norm-type) (default: pn)
  --placement P        pre | post | sandwich | deepnorm | rezero | output | mixln (default: pre)
  --qk-norm KIND       normalise each head's queries and keys (rmsnorm, ln, ...; see --qk-norm)
  --seed N             random seed (default: 1)
  --gpus N             GPUs, one process each (default: all visible; 0 = CPU)
  --world-size N       the workers of a run started on several machines (SLURM: one per
                       task) (default: --gpus)
  --tokens-per-update N  the batch per update, over all workers (default: the recipe's:
                       16,384 tokens on PTB, 32,768 on WikiText-103)
  --update-freq N      gradient accumulation; each worker's --max-tokens is then the batch
                       / (workers x N), which must divide (default: the fewest batches of at
                       most the recipe's --max-tokens; -- --max-tokens M sets that cap instead)
  --save-dir DIR       checkpoints and logs (default: checkpoints/lm-<dataset>-<norm>-<placement>-seed<N>)
  --dry-run            print the fairseq-train command and exit
  --verbose            show fairseq's whole log (always kept in <save-dir>/train.log)
Everything after -- goes to fairseq-train unchanged (and wins over the defaults), but
--max-tokens, the cap above, and --update-freq, this script's: workers x --max-tokens x
update-freq is always the batch per update, which train.log's first line states.
USAGE
}

die() { echo "train-lm.sh: error: $*" >&2; exit 2; }

DATASET=ptb NORM=pn PLACEMENT=pre SEED=1 GPUS="" WORLD_SIZE="" UPDATE_FREQ="" TOKENS_PER_UPDATE="" QK_NORM=""
DATA="" SAVE_DIR="" DRY_RUN="" EXTRA=()
read_config "$@"
declare -A OPTIONS=()
parse_run_options "$@"

check_norm --norm "$NORM"
check_run

# TOTAL_TOKENS is the batch per update
case "$DATASET" in
  ptb)  # our choice for a 1M-token corpus: 3 layers of transformer_lm's width, heavy dropout
    TOTAL_TOKENS=16384 MAX_TOKENS=4096
    HPARAMS=(--decoder-layers 3 --tokens-per-sample 256 --dropout 0.3 --attention-dropout 0.1
             --activation-dropout 0.1 --lr 0.0005 --warmup-updates 2000 --max-update 30000 --patience 10) ;;
  wikitext103)  # fairseq's examples/language_model transformer_lm recipe
    TOTAL_TOKENS=32768 MAX_TOKENS=2048
    HPARAMS=(--tokens-per-sample 512 --dropout 0.1 --lr 0.0005 --warmup-updates 4000
             --max-update 50000 --patience 5) ;;
  *) die "--dataset must be one of {ptb,wikitext103}, got '$DATASET'" ;;
esac
DATA="${DATA:-data-bin/$DATASET/bin}"
[[ -f "$DATA/dict.txt" || -n "$DRY_RUN" ]] || die "no binarized data in '$DATA' (run data-prep/prepare-lm.sh first, or pass --data)"

devices "$TOTAL_TOKENS" "$MAX_TOKENS"

SAVE_DIR="${SAVE_DIR:-checkpoints/lm-$DATASET-$NORM-$PLACEMENT-seed$SEED}"

cmd=(fairseq-train "$DATA" --user-dir "$ROOT/powernorm_fairseq" --task language_modeling
  --arch powernorm_transformer_lm --share-decoder-input-output-embed
  --norm-type "$NORM" --norm-placement "$PLACEMENT" ${QK_NORM:+--qk-norm "$QK_NORM"} --sample-break-mode none
  --optimizer adam --adam-betas "(0.9, 0.98)" --weight-decay 0.01 --clip-norm 0.0
  --lr-scheduler inverse_sqrt --warmup-init-lr 1e-07
  --max-tokens "$MAX_TOKENS" --update-freq "$UPDATE_FREQ" --seed "$SEED"
  --no-epoch-checkpoints --save-dir "$SAVE_DIR"
  --log-format simple --log-interval 50 --tensorboard-logdir "$SAVE_DIR/tensorboard"
  "${HPARAMS[@]}" "${DEVICE[@]}" "${EXTRA[@]}")

launch "train-lm.sh: $DATASET, $NORM, $PLACEMENT-norm, seed $SEED" "${cmd[@]}"
