"""The norm flags of the models: their arguments, checks and defaults.

``add_norm_args`` adds them to a model's parser, ``check_args`` rejects
combinations that would build a model the flags did not ask for, and
``powernorm_defaults`` fills in what was not given (each norm class turns
them into its constructor options, :meth:`powernorm_fairseq.norms.Norm.options`).
"""

import argparse
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Optional

from fairseq.dataclass import FairseqDataclass

from .. import patches
from ..common.errors import PowerNormConfigError
from ..common.flags import at_least, fraction, positive
from ..norms.placement import (LAYER_PLACEMENTS, PLACEMENTS, REZERO_GATES, check_layers, check_placement, expand,
                               final_norm, per_layer)
from ..norms.qk_norm import QK_SCOPES, check_qk_norm
from ..norms import GAIN_TYPES, NORM_TYPES, NORMS, RUNNING_STAT_TYPES
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
KINDS = "{" + ",".join(NORM_TYPES) + "}"


def _sublayer_kind(text):
    """A norm type, or the released code's spelling of one."""
    kind = ORIGINAL_SPELLINGS.get(text, text)
    if kind not in NORM_TYPES:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from {', '.join(NORM_TYPES)}, or layer, batch, power)")
    return kind


def all_kinds(args, sides=("encoder", "decoder")):
    """Every norm type the flags put in the model's ``sides``: each side's type
    and its sublayer flags."""
    names = ["norm_type" if side == "encoder" else "decoder_norm_type" for side in sides]
    names += [f[2:].replace("-", "_") for f in SUBLAYER_FLAGS if f.split("-")[2] in sides]
    listed = {kind for side in sides for kind in expand(getattr(args, f"{side}_layer_norms", None) or "")} - {""}
    return ({getattr(args, name, None) for name in names} | listed) - {None}


#: what a setting is to a model rebuilt from a checkpoint (``models/settings.py``)
FUNCTION, TRAINING = "function", "training"


def _flag(default, help, role, lm=True, kinds=None, **argparse_options):
    """A field of :class:`NormConfig`: its default (what a run gets when the
    flag is not given; None: decided per run, see ``powernorm_defaults``),
    help, its ``role`` (FUNCTION: part of what the model computes, the same
    wherever a model is rebuilt from a checkpoint; TRAINING: how it is
    trained, free to change on resume), the norm ``kinds`` it is an option of
    (None: of the model as a whole), and how argparse reads it (``lm``: the
    language model has it too)."""
    assert role in (FUNCTION, TRAINING)
    return field(default=default, metadata=dict(help=help, lm=lm, role=role, kinds=kinds, argparse=argparse_options))


def _sublayer(flag, lm=True):
    return _flag(None, f"the norm of {SUBLAYER_FLAGS[flag]} (default: its side's type)", FUNCTION, lm=lm,
                 type=_sublayer_kind,
                 metavar=KINDS)


INITS = ("default", "xavier-kaiming", "uniform:A", "smallinit")


def init_scheme(text):
    """An ``--init``: default, xavier-kaiming, smallinit, or uniform:A with A > 0."""
    kind, _, scale = str(text).partition(":")
    if kind == "uniform" and scale:
        try:
            if float(scale) > 0:
                return f"uniform:{float(scale):g}"
        except ValueError:
            pass
    elif text in INITS and text != "uniform:A":
        return text
    raise argparse.ArgumentTypeError(f"invalid --init {text!r}: choose one of {', '.join(INITS)} (A > 0)")


def _choice(values):
    return dict(choices=values, metavar="{" + ",".join(values) + "}")


@dataclass
class _ModelNormConfig(FairseqDataclass):
    """The norm flags of the models as a whole, and those several kinds share."""

    # fmt: off
    # what the model computes: it must match wherever a model is rebuilt from a checkpoint
    norm_type: str = _flag("pn", "every encoder norm: attention, FFN and the final norm; in the language "
                           "model every norm", FUNCTION, **_choice(NORM_TYPES))
    decoder_norm_type: str = _flag("ln", "every decoder norm (ln, as in the paper)", FUNCTION, lm=False,
                                   **_choice(NORM_TYPES))
    encoder_norm_self: Optional[str] = _sublayer("--encoder-norm-self", lm=False)
    encoder_norm_ff: Optional[str] = _sublayer("--encoder-norm-ff", lm=False)
    decoder_norm_self: Optional[str] = _sublayer("--decoder-norm-self")
    decoder_norm_cross: Optional[str] = _sublayer("--decoder-norm-cross", lm=False)
    decoder_norm_ff: Optional[str] = _sublayer("--decoder-norm-ff")
    norm_placement: str = _flag("pre", "where the norms sit (docs/norms.md#placements)", FUNCTION,
                                **_choice(PLACEMENTS))
    encoder_layer_norms: Optional[str] = _flag(None, "each encoder layer's kind, e.g. bn*2,ln*4", FUNCTION,
                                               lm=False, type=per_layer(NORM_TYPES, "--encoder-layer-norms"),
                                               metavar="KIND*N,...")
    decoder_layer_norms: Optional[str] = _flag(None, "each decoder layer's kind, e.g. bn*2,ln*4", FUNCTION,
                                               type=per_layer(NORM_TYPES, "--decoder-layer-norms"),
                                               metavar="KIND*N,...")
    encoder_layer_placements: Optional[str] = _flag(None, "each encoder layer's placement, e.g. post*2,pre*4",
                                                    FUNCTION, lm=False, metavar="P*N,...",
                                                    type=per_layer(LAYER_PLACEMENTS, "--encoder-layer-placements"))
    decoder_layer_placements: Optional[str] = _flag(None, "each decoder layer's placement, e.g. post*2,pre*4",
                                                    FUNCTION, metavar="P*N,...",
                                                    type=per_layer(LAYER_PLACEMENTS, "--decoder-layer-placements"))
    mixln_post_layers: Optional[int] = _flag(None, "Mix-LN's post-norm layers per side (default: a quarter, "
                                             "rounded down)", FUNCTION, type=at_least(0, "--mixln-post-layers"),
                                             metavar="K")
    norm_depth_scaling: bool = _flag(False, "LayerNorm Scaling: pre-norm layer l's norms times 1/sqrt(l)", FUNCTION,
                                     action="store_true")
    norm_unit_offset: bool = _flag(False, "every norm gain stored as gamma - 1 (a learned length g: g - sqrt(d)), "
                                   "from 0, and applied as 1 + gamma",
                                   FUNCTION, kinds=GAIN_TYPES, action="store_true")
    rezero_gates: str = _flag("sublayer", "ReZero's gates: one per sublayer, or one per layer (the authors' code)",
                              FUNCTION, **_choice(REZERO_GATES))
    qk_norm: Optional[str] = _flag(None, "a norm of each attention head's queries and keys (default: none; a "
                                   "per-token kind)", FUNCTION, type=_sublayer_kind, metavar=KINDS)
    qk_norm_scope: str = _flag("head", "what --qk-norm normalises: each head's queries and keys, or the whole "
                               "projections (OLMo 2)", FUNCTION,
                               **_choice(QK_SCOPES))
    fixnorm: bool = _flag(False, "unit-length word embeddings times a learned scale (needs tied embeddings)",
                          FUNCTION, action="store_true")
    pn_eps: float = _flag(1e-5, "PN and PN-V epsilon", FUNCTION, kinds=("pn", "pn-v"), type=positive)
    pn_group_scaling: Optional[bool] = _flag(None, "the pn-only spelling of --layer-scale (default: on, as the "
                                             "authors' code)", FUNCTION, kinds=("pn",),
                                             action=argparse.BooleanOptionalAction)
    layer_scale: Optional[bool] = _flag(None, "the paper's layer scale (Appendix A): per-token RMS scaling "
                                        "over groups = heads before every bn, rbn, pn-v and pn (default: "
                                        "on for pn, off for the others)", FUNCTION, kinds=("bn", "rbn", "pn-v", "pn"),
                                        action=argparse.BooleanOptionalAction)
    pn_backward: str = _flag("paper", "PN backward: Algorithm 2 of the paper, or the authors' released code",
                             FUNCTION, kinds=("pn",), **_choice(("paper", "reference")))
    adanorm_scale: float = _flag(1.0, "AdaNorm's C in z = C (1 - y/10) y", FUNCTION, kinds=("adanorm",),
                                 type=positive, metavar="C")
    detachnorm_detach: str = _flag("both", "what DetachNorm treats as constant in the backward pass", FUNCTION,
                                   kinds=("detachnorm",), **_choice(("both", "mean", "var")))
    layernorm_simple_std: str = _flag("biased", "the divisor of layernorm-simple and detachnorm: sqrt(biased "
                                      "var + eps), as LayerNorm, or unbiased std + eps, as Xu et al.'s code",
                                      FUNCTION, kinds=("layernorm-simple", "detachnorm"),
                                      **_choice(("biased", "unbiased")))
    norm_groups: Optional[int] = _flag(None, "channel groups of groupnorm (default: the attention heads)",
                                       FUNCTION, kinds=("groupnorm",), type=at_least(1, "--norm-groups"),
                                       metavar="G")
    norm_causal: bool = _flag(False, "decoder norms of batch statistics use their running ones in training too "
                              "(no leak of later tokens)", FUNCTION, kinds=RUNNING_STAT_TYPES,
                              action="store_true")
    # how the model is trained: free to change on resume (the change is logged)
    small_init: bool = _flag(False, "attention ~ N(0, sqrt(2/5d)), FFN ~ N(0, sqrt(2/(d+d_ff)))", TRAINING,
                             action="store_true")
    init: str = _flag("default", "initial weights: fairseq's (default), Xavier with Kaiming for the feed-forward "
                      "(xavier-kaiming), U(-A, A) (uniform:A), or SmallInit; biases at 0", TRAINING,
                      type=init_scheme, metavar="{" + ",".join(INITS) + "}")
    pn_alpha_fwd: float = _flag(0.9, "PN running psi^2 decay, in (0, 1)", TRAINING, type=fraction("--pn-alpha-fwd"))
    pn_alpha_bwd: float = _flag(0.9, "PN running nu decay, in (0, 1)", TRAINING, type=fraction("--pn-alpha-bwd"))
    pn_warmup_updates: Optional[int] = _flag(None, "PN forwards that use batch statistics (default: "
                                             "--warmup-updates)", TRAINING, type=at_least(0))
    norm_momentum: Optional[float] = _flag(None, "running-statistics momentum of bn, rbn, pn-v and bn-original "
                                           "(default: 0.1; 0.05 for bn-original and rbn, as in their authors' "
                                           "code)",
                                           TRAINING, type=fraction("--norm-momentum"))
    norm_sync: Optional[str] = _flag(None, "batch statistics across data-parallel workers: the global batch's, "
                                     "shared running ones, or none (default: batch; none with --pn-backward "
                                     "reference)",
                                     TRAINING, **_choice(SYNC_MODES))
    norm_diagnostics: bool = _flag(False, "log batch vs running statistics, their gradient terms and TID (diag/... "
                                   "metrics)", TRAINING, action="store_true")
    norm_diagnostics_interval: int = _flag(1, "measure every N updates", TRAINING,
                                           type=at_least(1, "--norm-diagnostics-interval"), metavar="N")
    allow_setting_changes: bool = _flag(False, "load a checkpoint of other function settings (a deliberate "
                                        "fine-tune; each change logged)", TRAINING,
                                        action="store_true")
    # fmt: on


def _kinds_own_flags():
    """Each kind's own flags, as its module declares them (``Norm.flags``)."""
    for kind, cls in NORMS.items():
        for name, f in cls.flags.items():
            yield name, type(f.default), _flag(f.default, f.help, f.role, kinds=(kind,), **f.argparse)


#: Every norm flag of the plugin's models, defined once: the fields of the models'
#: hydra configs, and (``add_norm_args``) their command-line flags; a kind's own
#: flags come from its module (``Norm.flags``)
NormConfig = make_dataclass("NormConfig", list(_kinds_own_flags()), bases=(_ModelNormConfig,))
NormConfig.__module__, NormConfig.__doc__ = __name__, "Every norm flag of the plugin's models."


def norm_fields(lm=False):
    """The fields of :class:`NormConfig` a model has."""
    return [f for f in fields(NormConfig) if "argparse" in f.metadata and (f.metadata["lm"] or not lm)]


def add_norm_args(parser, lm=False):
    """The norm flags of powernorm_transformer, or of the decoder-only
    powernorm_transformer_lm (``lm``: one side, so no decoder/encoder split),
    from :class:`NormConfig`. A flag not given is left out of the namespace
    (fairseq's model groups suppress defaults), and ``powernorm_defaults``
    fills it in."""
    for f in norm_fields(lm):
        options = dict(f.metadata["argparse"])
        shown = f.default if f.default is not None or options.get("action") else None
        text = f.metadata["help"]
        if shown is not None and "default:" not in text and options.get("action") != "store_true":
            text += f" (default: {shown})"
        parser.add_argument("--" + f.name.replace("_", "-"), help=text, **options)


def check_values(args):
    """The flags' own checks, for values that did not come through argparse
    (a hydra config, a checkpoint's saved config): one line naming the flag."""
    for f in norm_fields():
        value, options = getattr(args, f.name, None), f.metadata["argparse"]
        if value is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        allowed = options.get("choices")
        if allowed is not None and value not in allowed:
            raise PowerNormConfigError(f"{flag} {value}: choose one of {', '.join(allowed)}")
        parse = options.get("type")
        if parse is not None:
            try:
                setattr(args, f.name, parse(str(value)))
            except (argparse.ArgumentTypeError, ValueError) as err:
                text = str(err)
                raise PowerNormConfigError(text if text.startswith(flag) else f"{flag} {text}") from None


def check_args(args, sides=("encoder", "decoder")):
    """Reject flag combinations that would leave a norm the flags did not ask
    for (``sides``: those the model has)."""
    kinds = all_kinds(args)
    try:
        check_placement(args, all_kinds(args, sides))
        check_layers(args, sides)
        check_qk_norm(args.qk_norm, getattr(args, "qk_norm_scope", None) or "head")
    except ValueError as err:
        raise PowerNormConfigError(str(err)) from None
    for side in sides:
        given = [f for f in SUBLAYER_FLAGS if f.split("-")[2] == side and getattr(args, f[2:].replace("-", "_"), None)]
        if getattr(args, f"{side}_layer_norms", None) and given:
            raise PowerNormConfigError(f"--{side}-layer-norms sets every {side} norm layer by layer, and {given[0]} "
                                       "every one of its sublayer: use one of them")
    if getattr(args, "layernorm_embedding", False):
        raise PowerNormConfigError(
            "--layernorm-embedding adds a LayerNorm that --norm-type does not control; "
            "drop it (powernorm_transformer has no embedding norm)"
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
    qk = {args.qk_norm} - {None, "none"}
    if getattr(args, "norm_unit_offset", False) and not (kinds | qk) & set(GAIN_TYPES):
        raise PowerNormConfigError(f"--norm-unit-offset: no norm of the model has a gain "
                                   f"({', '.join(sorted(kinds | qk))}); the kinds with one: {', '.join(GAIN_TYPES)}")
    if "bn-original" in kinds and args.norm_sync not in (None, "none"):
        raise PowerNormConfigError(
            "bn-original reproduces the released code, which never synchronised statistics "
            f"across workers: use --norm-sync none (got --norm-sync {args.norm_sync})"
        )
    if "rbn" in kinds and any(getattr(args, f, False) for f in ("checkpoint_activations", "offload_activations")):
        raise PowerNormConfigError(
            "rbn's penalty needs the graph of each forward, which --checkpoint-activations (fairseq's reentrant "
            "checkpointing) does not keep: drop --checkpoint-activations, or use bn")
    for side in ("encoder", "decoder"):
        dim = getattr(args, f"{side}_embed_dim", None)  # a language model has no encoder
        if dim and "groupnorm" in kinds and args.norm_groups and dim % args.norm_groups:
            raise PowerNormConfigError(
                f"--norm-groups {args.norm_groups} does not divide --{side}-embed-dim {dim}")
    if args.small_init and args.init not in ("default", "smallinit"):
        raise PowerNormConfigError(f"--small-init contradicts --init {args.init}; use --init alone")
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
    for f in norm_fields():  # NormConfig's defaults; None ones are decided below or per kind
        if getattr(args, f.name, None) is None:
            setattr(args, f.name, f.default)
    check_values(args)  # a hydra config's values have not been through argparse
    for side in ("encoder", "decoder"):
        before = final_norm(args, side)
        flag = f"{side}_normalize_before"
        if getattr(args, flag, False) and not before:
            raise PowerNormConfigError(
                f"--{flag.replace('_', '-')} contradicts --norm-placement {args.norm_placement}; "
                "use --norm-placement alone"
            )
        setattr(args, flag, before)
    if args.fixnorm:  # the FixNorm length g replaces fairseq's sqrt(d) embedding scale
        args.no_scale_embedding = True
    if args.pn_warmup_updates is None:
        args.pn_warmup_updates = getattr(args, "warmup_updates", 0) or 0

