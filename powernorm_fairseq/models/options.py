"""The norm flags of the models: their arguments, checks and defaults.

``add_norm_args`` adds them to a model's parser, ``check_args`` rejects
combinations that would build a model the flags did not ask for, and
``powernorm_defaults`` fills in what was not given (each norm class turns
them into its constructor options, :meth:`powernorm_fairseq.norms.Norm.options`).
"""

import argparse

from .. import patches
from ..common.errors import PowerNormConfigError
from ..common.flags import at_least, fraction, positive
from ..norms import NORM_TYPES, RUNNING_STAT_TYPES
from ..norms.sync import MODES as SYNC_MODES



SUBLAYER_FLAGS = {
    "--encoder-norm-self": "every encoder self-attention sublayer",
    "--encoder-norm-ff": "every encoder feed-forward sublayer",
    "--decoder-norm-self": "every decoder self-attention sublayer",
    "--decoder-norm-cross": "every decoder encoder-attention sublayer",
    "--decoder-norm-ff": "every decoder feed-forward sublayer",
}
LM_SUBLAYER_FLAGS = ("--decoder-norm-self", "--decoder-norm-ff")
#: the spellings of the authors' released code (its --encoder-norm-self etc.)
ORIGINAL_SPELLINGS = {"layer": "ln", "batch": "bn", "power": "pn"}


def _sublayer_kind(text):
    """A norm type, or the released code's spelling of one."""
    kind = ORIGINAL_SPELLINGS.get(text, text)
    if kind not in NORM_TYPES:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from {', '.join(NORM_TYPES)}, or layer, batch, power)")
    return kind


def all_kinds(args):
    """Every norm type the flags put in the model."""
    subs = [getattr(args, f[2:].replace("-", "_"), None) for f in SUBLAYER_FLAGS]
    return {args.norm_type, args.decoder_norm_type, *(k for k in subs if k)}


def add_norm_args(parser, lm=False):
    """The norm flags of powernorm_transformer, or of the decoder-only
    powernorm_transformer_lm (``lm``: one side, so no decoder/encoder split)."""
    # fmt: off
    if lm:
        parser.add_argument("--norm-type", choices=NORM_TYPES, metavar="{" + ",".join(NORM_TYPES) + "}",
                            help="every norm of the language model (default: pn)")
    else:
        parser.add_argument("--norm-type", choices=NORM_TYPES, metavar="{" + ",".join(NORM_TYPES) + "}",
                            help="every encoder norm: attention, FFN and the final norm (default: pn)")
        parser.add_argument("--decoder-norm-type", choices=NORM_TYPES,
                            metavar="{" + ",".join(NORM_TYPES) + "}",
                            help="every decoder norm (default: ln, as in the paper)")
    for flag, what in SUBLAYER_FLAGS.items():
        if lm and flag not in LM_SUBLAYER_FLAGS:
            continue
        parser.add_argument(flag, type=_sublayer_kind, metavar="{" + ",".join(NORM_TYPES) + "}",
                            help=f"the norm of {what}, overriding the type of its side; also takes the "
                                 "original code's layer, batch, power")
    parser.add_argument("--norm-placement", choices=("pre", "post"),
                        help="norm before each sublayer (pre) or after the residual sum (post); default: pre")
    parser.add_argument("--fixnorm", action="store_true",
                        help="unit-length word embeddings times a learned scale (needs tied embeddings)")
    parser.add_argument("--small-init", action="store_true",
                        help="attention ~ N(0, sqrt(2/5d)), FFN ~ N(0, sqrt(2/(d+d_ff)))")
    parser.add_argument("--pn-alpha-fwd", type=fraction("--pn-alpha-fwd"),
                        help="PN running psi^2 decay, in (0, 1) (default: 0.9)")
    parser.add_argument("--pn-alpha-bwd", type=fraction("--pn-alpha-bwd"),
                        help="PN running nu decay, in (0, 1) (default: 0.9)")
    parser.add_argument("--pn-warmup-updates", type=at_least(0),
                        help="PN forwards that use batch statistics (default: --warmup-updates)")
    parser.add_argument("--pn-eps", type=positive, help="PN and PN-V epsilon (default: 1e-5)")
    parser.add_argument("--pn-group-scaling", action=argparse.BooleanOptionalAction,
                        help="per-token RMS scaling over groups = heads before PN, "
                             "as in the authors' code (default: on); the pn-only spelling of --layer-scale")
    parser.add_argument("--layer-scale", action=argparse.BooleanOptionalAction,
                        help="the paper's layer scale (Appendix A): per-token RMS scaling over groups = "
                             "heads before every bn, pn-v and pn (default: on for pn, off for bn and pn-v)")
    parser.add_argument("--pn-backward", choices=("paper", "reference"),
                        help="PN backward: Algorithm 2 of the paper, or the authors' "
                             "released code (default: paper)")
    parser.add_argument("--norm-momentum", type=fraction("--norm-momentum"),
                        help="running-statistics momentum of bn, pn-v and bn-original "
                             "(default: 0.1; 0.05 for bn-original, as in the authors' code)")
    parser.add_argument("--adanorm-scale", type=positive, metavar="C",
                        help="AdaNorm's C in z = C (1 - y/10) y (default: 1)")
    parser.add_argument("--detachnorm-detach", choices=("both", "mean", "var"),
                        help="what DetachNorm treats as constant in the backward pass (default: both)")
    parser.add_argument("--layernorm-simple-std", choices=("biased", "unbiased"),
                        help="the divisor of layernorm-simple and detachnorm: sqrt(biased var + eps), "
                             "as LayerNorm, or unbiased std + eps, as Xu et al.'s code (default: biased)")
    parser.add_argument("--norm-groups", type=at_least(1, "--norm-groups"), metavar="G",
                        help="channel groups of groupnorm (default: the attention heads)")
    parser.add_argument("--norm-sync", choices=SYNC_MODES,
                        help="statistics of bn, pn-v and pn across data-parallel workers: batch = "
                             "normalise with the global batch (exact gradient through the all-reduce), "
                             "running = per-worker batch, identical running statistics, none = per "
                             "worker (default: batch; none with --pn-backward reference; "
                             "bn-original is always none)")
    parser.add_argument("--norm-diagnostics", action="store_true",
                        help="log batch vs running statistics distances and the gradient terms "
                             "of the statistics for every bn, bn-original, pn-v and pn layer (diag/... metrics)")
    parser.add_argument("--norm-diagnostics-interval", type=at_least(1, "--norm-diagnostics-interval"), metavar="N",
                        help="measure every N updates (default: 1)")
    # fmt: on


def check_args(args):
    """Reject flag combinations that would leave a norm the flags did not ask for."""
    kinds = all_kinds(args)
    if getattr(args, "layernorm_embedding", False):
        raise PowerNormConfigError(
            "--layernorm-embedding adds a LayerNorm that --norm-type does not control; "
            "drop it (powernorm_transformer has no embedding norm)"
        )
    for flag in ("scale_attn", "scale_fc"):
        if getattr(args, flag, False):
            raise PowerNormConfigError(
                f"--{flag.replace('_', '-')} adds a LayerNorm that --norm-type does not control; drop it"
            )
    if getattr(args, "checkpoint_activations", False) and any(k in RUNNING_STAT_TYPES for k in kinds):
        raise PowerNormConfigError(
            "--checkpoint-activations recomputes forwards, which would update running "
            "statistics twice; use --norm-type/--decoder-norm-type in {ln,scalenorm} or drop it"
        )
    if args.pn_backward == "reference" and args.norm_sync not in (None, "none") and "pn" in kinds:
        raise PowerNormConfigError(
            "--pn-backward reference reproduces the released code, which never synchronised "
            f"statistics across workers: use --norm-sync none (got --norm-sync {args.norm_sync})"
        )
    if None not in (args.layer_scale, args.pn_group_scaling) and args.layer_scale != args.pn_group_scaling:
        said = [f"--{'' if on else 'no-'}{flag}"
                for flag, on in (("layer-scale", args.layer_scale), ("pn-group-scaling", args.pn_group_scaling))]
        raise PowerNormConfigError(f"{said[0]} contradicts {said[1]}; use --layer-scale/--no-layer-scale alone")
    if "bn-original" in kinds and args.norm_sync not in (None, "none"):
        raise PowerNormConfigError(
            "bn-original reproduces the released code, which never synchronised statistics "
            f"across workers: use --norm-sync none (got --norm-sync {args.norm_sync})"
        )
    for side in ("encoder", "decoder"):
        dim = getattr(args, f"{side}_embed_dim", None)  # a language model has no encoder
        if dim and "groupnorm" in kinds and args.norm_groups and dim % args.norm_groups:
            raise PowerNormConfigError(
                f"--norm-groups {args.norm_groups} does not divide --{side}-embed-dim {dim}")
    if args.fixnorm and getattr(args, "adaptive_input", False):
        raise PowerNormConfigError("--fixnorm replaces the word embeddings, --adaptive-input too: drop one")
    if args.fixnorm and not (getattr(args, "share_all_embeddings", False)
                             or args.share_decoder_input_output_embed):
        ties = "--share-all-embeddings or " if hasattr(args, "share_all_embeddings") else ""
        raise PowerNormConfigError(f"--fixnorm needs tied embeddings: add {ties}--share-decoder-input-output-embed")


def powernorm_defaults(args):
    """What every architecture of the plugin fills in. fairseq calls an
    architecture once its flags are parsed, before it reads the data or the
    save directory: the run of a plugin model gets ``patches.WITH_THE_MODELS``
    here (fairseq calls every model's ``add_args`` at import, so that cannot)."""
    patches.for_the_models()
    args.norm_type = getattr(args, "norm_type", "pn")
    args.decoder_norm_type = getattr(args, "decoder_norm_type", "ln")
    args.norm_placement = getattr(args, "norm_placement", "pre")
    pre = args.norm_placement == "pre"
    for side in ("encoder", "decoder"):
        flag = f"{side}_normalize_before"
        if getattr(args, flag, False) and not pre:
            raise PowerNormConfigError(
                f"--{flag.replace('_', '-')} contradicts --norm-placement post; "
                "use --norm-placement {pre,post} alone"
            )
        setattr(args, flag, pre)
    args.fixnorm = getattr(args, "fixnorm", False)
    if args.fixnorm:  # the FixNorm length g replaces fairseq's sqrt(d) embedding scale
        args.no_scale_embedding = True
    args.small_init = getattr(args, "small_init", False)
    args.pn_alpha_fwd = getattr(args, "pn_alpha_fwd", 0.9)
    args.pn_alpha_bwd = getattr(args, "pn_alpha_bwd", 0.9)
    args.pn_warmup_updates = getattr(args, "pn_warmup_updates", getattr(args, "warmup_updates", 0))
    args.pn_eps = getattr(args, "pn_eps", 1e-5)
    args.pn_group_scaling = getattr(args, "pn_group_scaling", None)  # see modules.layer_scale
    args.layer_scale = getattr(args, "layer_scale", None)
    args.pn_backward = getattr(args, "pn_backward", "paper")
    args.norm_momentum = getattr(args, "norm_momentum", None)  # per kind, see norm_options
    for flag in SUBLAYER_FLAGS:
        name = flag[2:].replace("-", "_")
        value = getattr(args, name, None)
        setattr(args, name, ORIGINAL_SPELLINGS.get(value, value))
    args.adanorm_scale = getattr(args, "adanorm_scale", 1.0)
    args.detachnorm_detach = getattr(args, "detachnorm_detach", "both")
    args.layernorm_simple_std = getattr(args, "layernorm_simple_std", "biased")
    args.norm_groups = getattr(args, "norm_groups", None)
    args.norm_sync = getattr(args, "norm_sync", None)
    args.norm_diagnostics = getattr(args, "norm_diagnostics", False)
    args.norm_diagnostics_interval = getattr(args, "norm_diagnostics_interval", 1)

