#!/usr/bin/env bash
# Train one row of the PowerNorm paper's Table 1 (or a variant) with fairseq-train.
# Defaults are the paper's hyperparameters (Shen et al., 2020, Appendix A);
# configs/*.sh hold the rows, each listing only what differs from these.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # ROOT
whole "$@"
environment  # fairseq and the tools, from .venv if no environment is active

usage() {
  cat <<USAGE
usage: scripts/train.sh [--config FILE] [--dataset NAME] [--norm KIND] [options] [-- FAIRSEQ_FLAGS...]

  --config FILE        a row from configs/ (sets DATASET, NORM, DECODER_NORM, PLACEMENT, QK_NORM, EXTRA)
  --dataset NAME       iwslt14 | wmt14 | quickstart (default: iwslt14)
  --data DIR           binarized data (default: data-bin/<dataset>/bin)
  --norm KIND          encoder norm: ln | bn | pn | pn-v | bn-original | scalenorm |
                       rmsnorm | ... (see --norm-type) (default: pn)
  --decoder-norm KIND  decoder norm (default: ln, as in the paper)
  --placement P        pre | post | sandwich | deepnorm | rezero | output | mixln (default: pre)
  --qk-norm KIND       normalise each head's queries and keys (rmsnorm, ln, ...; see --qk-norm)
  --seed N             random seed (default: 1)
  --gpus N             GPUs, one process each (default: all visible; 0 = CPU)
  --world-size N       the workers of a run started on several machines (SLURM: one per
                       task) (default: --gpus)
  --tokens-per-update N  the batch per update, over all workers (default: the paper's:
                       4,096 tokens on IWSLT14, 131,072 on WMT14; 2,048 quickstart)
  --update-freq N      gradient accumulation; each worker's --max-tokens is then the batch
                       / (workers x N), which must divide (default: the fewest batches of
                       at most 4,096 tokens; -- --max-tokens M sets that cap instead)
  --average N          epoch checkpoints kept for evaluate.sh to average (default: 10;
                       quickstart 3)
  --save-dir DIR       checkpoints and logs (default: checkpoints/<dataset>-<norm>-<placement>-seed<N>)
  --dry-run            print the fairseq-train command and exit
  --verbose            show fairseq's whole log (always kept in <save-dir>/train.log)
Everything after -- goes to fairseq-train unchanged (and wins over the defaults), but
--max-tokens, the cap above, and --update-freq, this script's: workers x --max-tokens x
update-freq is always the batch per update, which train.log's first line states.
USAGE
}

die() { echo "train.sh: error: $*" >&2; exit 2; }

DATASET=iwslt14 NORM=pn DECODER_NORM=ln PLACEMENT=pre SEED=1 GPUS="" WORLD_SIZE="" UPDATE_FREQ="" TOKENS_PER_UPDATE="" QK_NORM=""
DATA="" SAVE_DIR="" DRY_RUN="" EXTRA=() AVERAGE=""
read_config "$@"
declare -A OPTIONS=([--decoder-norm]=DECODER_NORM [--average]=AVERAGE)
parse_run_options "$@"

check_norm --norm "$NORM"
check_norm --decoder-norm "$DECODER_NORM"
check_run

# the paper's hyperparameters per dataset (docs/recipes.md#the-settings: the paper's text, the authors'
# scripts, ours and why); TOTAL_TOKENS is the batch per update, KEEP the epoch checkpoints averaged
case "$DATASET" in
  iwslt14)  # Appendix A, IWSLT14 small: at most 100k updates, early stopping after 5 epochs, the last 10 averaged
    ARCH=powernorm_transformer_iwslt_de_en TOTAL_TOKENS=4096 MAX_TOKENS=4096 KEEP=10
    HPARAMS=(--lr 0.0015 --dropout 0.3 --attention-dropout 0.1 --activation-dropout 0.1
             --weight-decay 0.0001 --max-update 100000 --patience 5) ;;
  wmt14)  # Appendix A, WMT14 big: the batch and lr enlarged as Ott et al. (2018), lr 0.003 as the authors'
    # script; at most 300k updates, early stopping after 10 epochs, the last 10 averaged; fp16 on a GPU
    ARCH=powernorm_transformer_wmt_en_de_big TOTAL_TOKENS=131072 MAX_TOKENS=4096 KEEP=10
    HPARAMS=(--lr 0.003 --dropout 0.3 --weight-decay 0.0 --max-update 300000 --patience 10) ;;
  quickstart)  # a CPU-sized IWSLT14 small: 3+3 layers, 256 dims, a few minutes per run
    ARCH=powernorm_transformer_iwslt_de_en TOTAL_TOKENS=2048 MAX_TOKENS=2048 KEEP=3
    HPARAMS=(--encoder-layers 3 --decoder-layers 3 --encoder-embed-dim 256 --decoder-embed-dim 256
             --encoder-ffn-embed-dim 512 --decoder-ffn-embed-dim 512 --lr 0.002 --warmup-updates 300
             --dropout 0.2 --weight-decay 0.0001 --max-epoch 8) ;;
  *) die "--dataset must be one of {iwslt14,wmt14,quickstart}, got '$DATASET'" ;;
esac
if [[ -n "$AVERAGE" ]]; then
  [[ "$AVERAGE" =~ ^[1-9][0-9]*$ ]] || die "--average must be a positive integer, got '$AVERAGE'"
  KEEP=$AVERAGE
fi
DATA="${DATA:-data-bin/$DATASET/bin}"
[[ -f "$DATA/dict.en.txt" || -n "$DRY_RUN" ]] || die "no binarized data in '$DATA' (run data-prep/ first, or pass --data)"

devices "$TOTAL_TOKENS" "$MAX_TOKENS"
[[ "$DATASET" != wmt14 || "$GPUS" == 0 ]] || DEVICE+=(--fp16)

SAVE_DIR="${SAVE_DIR:-checkpoints/$DATASET-$NORM-$PLACEMENT-seed$SEED}"

cmd=(fairseq-train "$DATA" --user-dir "$ROOT/powernorm_fairseq"
  --arch "$ARCH" --share-all-embeddings
  --norm-type "$NORM" --decoder-norm-type "$DECODER_NORM" --norm-placement "$PLACEMENT" ${QK_NORM:+--qk-norm "$QK_NORM"}
  --optimizer adam --adam-betas "(0.9, 0.98)" --clip-norm 0.0
  --lr-scheduler inverse_sqrt --warmup-init-lr 1e-07 --warmup-updates 8000
  --criterion label_smoothed_cross_entropy --label-smoothing 0.1
  --max-tokens "$MAX_TOKENS" --update-freq "$UPDATE_FREQ" --seed "$SEED"
  --keep-last-epochs "$KEEP" --save-dir "$SAVE_DIR"
  --log-format simple --log-interval 50 --tensorboard-logdir "$SAVE_DIR/tensorboard"
  "${HPARAMS[@]}" "${DEVICE[@]}" "${EXTRA[@]}")

launch "train.sh: $DATASET, encoder $NORM, decoder $DECODER_NORM, $PLACEMENT-norm, seed $SEED" "${cmd[@]}"
