"""What the translation model and the language model add to their fairseq
parents: flag checks, SmallInit, diagnostics, FixNorm embeddings and a
one-line error for a checkpoint with other norms."""

import argparse
import math

import torch
from fairseq.modules import MultiheadAttention
from omegaconf import OmegaConf
from torch import nn

from .. import patches
from ..common.errors import PowerNormConfigError
from ..modules import FixNormEmbedding, PowerNormDecoderLayer, PowerNormEncoderLayer
from ..norms.placement import deepnorm_
from ..norms import NORM_TYPES, Norm, build_norm, kernels, norm_type_of
from .diagnostics import NormDiagnostics
from . import settings
from .options import check_args


def check_model_keys(cls, args):
    """A hydra config's model keys must be settings of the model: its flags, or
    what its architecture fills in. Hydra takes any key, so a misspelled norm
    option would otherwise train the default norm silently."""
    import difflib

    from fairseq.models import ARCH_CONFIG_REGISTRY

    parser = argparse.ArgumentParser(add_help=False)
    cls.add_args(parser)
    known = {action.dest for action in parser._actions} | {"_name", "arch"}
    arch = getattr(args, "_name", None) or getattr(args, "arch", None)
    if arch in ARCH_CONFIG_REGISTRY:
        filled = argparse.Namespace()
        ARCH_CONFIG_REGISTRY[arch](filled)
        known |= set(vars(filled))
    for key in sorted(set(vars(args)) - known):
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
        hint = f" (did you mean model.{close[0]}?)" if close else ""
        raise PowerNormConfigError(f"model.{key}: not a setting of {arch}{hint}")


class PowerNormModelMixin:
    """What the translation model and the language model add to their fairseq
    parents: flag checks, SmallInit, diagnostics, FixNorm embeddings and a
    one-line error for a checkpoint with other norms."""

    #: the flag that sets the norms of each part, for check_norm_state's message
    NORM_FLAGS = {"encoder": "--norm-type", "decoder": "--decoder-norm-type"}

    @classmethod
    def build_model(cls, args, task):
        patches.for_the_models()  # also for generate, eval-lm and each distributed worker
        if OmegaConf.is_config(args):  # fairseq-hydra-train, or a checkpoint's saved config
            # fairseq's parents copy a config into a TransformerConfig field by field and
            # drop the keys it does not declare (the norm flags); a namespace keeps them all
            args = argparse.Namespace(**OmegaConf.to_container(args, resolve=True))
            check_model_keys(cls, args)
        check_args(args, tuple(cls.NORM_FLAGS))
        try:
            kernels.check_environment()
        except ValueError as err:
            raise PowerNormConfigError(str(err)) from None
        if getattr(args, "fp16", False) and not getattr(args, "fp16_no_flatten_grads", False) \
                and not torch.cuda.is_available():
            flag = "--memory-efficient-fp16" if getattr(args, "memory_efficient_fp16", False) else "--fp16"
            add = "--fp16-no-flatten-grads" if getattr(args, "cpu", False) else "--cpu --fp16-no-flatten-grads"
            raise PowerNormConfigError(f"{flag} without a GPU: fairseq's flattened fp16 master weights need CUDA; "
                                       f"train on a GPU, or add {add}")
        model = super().build_model(args, task)
        model.built_with = args  # what a checkpoint it loads must have been trained with (settings.check_load)
        initialize_(model, "smallinit" if args.small_init else args.init)
        if args.norm_placement == "deepnorm":
            deepnorm_(model)
        if args.norm_diagnostics:
            model.norm_diagnostics = NormDiagnostics(model, args.norm_diagnostics_interval)
        return model

    norm_diagnostics = None

    def set_num_updates(self, num_updates):
        super().set_num_updates(num_updates)
        if self.norm_diagnostics is not None:
            self.norm_diagnostics.set_num_updates(num_updates)

    @classmethod
    def build_embedding(cls, cfg, dictionary, embed_dim, path=None):
        if not getattr(cfg, "fixnorm", False):
            return super().build_embedding(cfg, dictionary, embed_dim, path)
        if path:
            raise PowerNormConfigError("--fixnorm cannot start from pretrained embeddings (--*-embed-path)")
        return FixNormEmbedding(len(dictionary), embed_dim, dictionary.pad())

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        settings.check_load(self, state_dict)
        check_norm_state(self, state_dict, self.NORM_FLAGS)
        own = self.state_dict()
        differ = [(k, tuple(v.shape), tuple(own[k].shape)) for k, v in state_dict.items()
                  if k in own and hasattr(v, "shape") and tuple(v.shape) != tuple(own[k].shape)]
        if differ:
            name, theirs, ours = differ[0]
            raise PowerNormConfigError(
                f"the checkpoint's tensors have other shapes than the model's ({len(differ)}, e.g. {name}: "
                f"checkpoint {list(theirs)}, model {list(ours)}): it was trained with other dimensions or "
                "another dictionary; pass its flags and data, or another --save-dir")
        return super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)


def initialize_(model, scheme):
    """``--init``: ``default`` keeps fairseq's; ``xavier-kaiming`` is the
    sentiment study's (Kaiming uniform for the ReLU feed-forward's two layers,
    Xavier uniform for every other weight matrix and embedding); ``uniform:A``
    draws each of them from U(-A, A); ``smallinit`` is :func:`small_init_`.
    Biases start at 0, padding embeddings at 0, and the norms at their own start."""
    if scheme == "default":
        return
    if scheme == "smallinit":
        return small_init_(model)
    layers = (PowerNormEncoderLayer, PowerNormDecoderLayer)
    feed_forward = {id(fc) for layer in model.modules() if isinstance(layer, layers) for fc in (layer.fc1, layer.fc2)}
    scale = float(scheme.partition(":")[2]) if scheme.startswith("uniform:") else None
    with torch.no_grad():
        for module in model.modules():
            if not isinstance(module, (nn.Linear, nn.Embedding)):
                continue
            if scale is not None:
                nn.init.uniform_(module.weight, -scale, scale)
            elif id(module) in feed_forward:
                nn.init.kaiming_uniform_(module.weight, nonlinearity="relu")
            else:
                nn.init.xavier_uniform_(module.weight)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
            if getattr(module, "padding_idx", None) is not None:
                module.weight[module.padding_idx].zero_()


def small_init_(model):
    """SmallInit (Nguyen & Salazar, 2019, Section 2.4): Xavier normal with the
    attention fan taken as d + 4d, and the FFN's true fan d + d_ff."""
    for module in model.modules():
        if isinstance(module, MultiheadAttention):
            std = math.sqrt(2.0 / (5 * module.embed_dim))
            for proj in (module.q_proj, module.k_proj, module.v_proj, module.out_proj):
                nn.init.normal_(proj.weight, mean=0.0, std=std)
        elif isinstance(module, (PowerNormEncoderLayer, PowerNormDecoderLayer)):
            d, d_ff = module.fc1.in_features, module.fc1.out_features
            std = math.sqrt(2.0 / (d + d_ff))
            for fc in (module.fc1, module.fc2):
                nn.init.normal_(fc.weight, mean=0.0, std=std)


#: entries a checkpoint from an older version may lack (the norm fills them in on load)
_OPTIONAL_KEYS = frozenset({"nu_scale"})
_STATE_KEYS = {}  # the state-dict entries of a norm -> the kinds that have exactly them
for _kind in NORM_TYPES:
    _STATE_KEYS.setdefault(frozenset(build_norm(_kind, 4).state_dict()) - _OPTIONAL_KEYS, set()).add(_kind)


def check_norm_state(model, state_dict, flags):
    """Fail in one line when a checkpoint's norms are not the model's.

    Kinds with the same entries (ln and groupnorm; the parameter-free ones)
    cannot be told apart by a checkpoint and are accepted for one another.
    ``flags`` names the flag that sets the norms of each part of the model.
    """
    found, wanted = {}, {}
    for name, module in model.named_modules():
        if not isinstance(module, Norm):
            continue
        keys = frozenset(k[len(name) + 1:] for k in state_dict if k.startswith(name + ".")) - _OPTIONAL_KEYS
        part, kind = name.split(".")[0], norm_type_of(module)
        kinds = _STATE_KEYS.get(keys, {"unknown"})
        found.setdefault(part, set()).add(kind if kind in kinds else "|".join(sorted(kinds)))
        wanted.setdefault(part, set()).add(kind)
    if found != wanted:
        have = ", ".join(f"{p} {'/'.join(sorted(k))}" for p, k in sorted(found.items()))
        need = ", ".join(f"{p} {'/'.join(sorted(k))}" for p, k in sorted(wanted.items()))
        fix = " ".join(
            f"{flags.get(p, p)} {sorted(k)[0]}" for p, k in sorted(found.items())
            if k != wanted.get(p) and len(k) == 1 and "unknown" not in k and "|" not in sorted(k)[0]
        )
        raise PowerNormConfigError(
            f"checkpoint norms ({have}) do not match the model ({need})"
            + (f"; pass {fix}" if fix else "")
        )
