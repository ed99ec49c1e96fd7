"""A model rebuilt from a checkpoint computes what the checkpoint's model computed.

Every flag of :class:`~.options.NormConfig` is either part of the model's
function (role FUNCTION: the norm kinds of each sublayer, the placement,
QK-norm, FixNorm, the layer scale, each norm's own options) or of its
training (role TRAINING: initialisation, the running statistics' decay,
synchronisation, diagnostics). Parameter-free kinds and placements change the
function without changing a parameter key, so a model is compared with its
checkpoint by these settings, not by its state dict alone: on resume,
``--finetune-from-model``, ``--model-overrides``, the hub's
``from_pretrained``, ``powernorm-average`` and ``powernorm-analyze``. A
function setting that differs is refused in one line naming it, its value in
the checkpoint and the value asked for; a training setting that differs is
logged. ``--allow-setting-changes`` lets a fine-tune change the function on
purpose (each change logged).
"""

import argparse
import logging
import weakref
from dataclasses import fields

from ..common.checkpoints import model_config, setting_of
from ..common.errors import PowerNormConfigError
from ..patches.checkpoints import REBUILD_CHECKS
from .options import FUNCTION, SUBLAYER_FLAGS, NormConfig, all_kinds

logger = logging.getLogger(__name__)

#: fairseq's own settings that change the function without changing a parameter's shape
FAIRSEQ_FUNCTION = ("encoder_attention_heads", "decoder_attention_heads", "activation_fn", "no_scale_embedding",
                    "no_token_positional_embeddings", "cross_self_attention")
ALLOW = "--allow-setting-changes"
_FIELDS = {f.name: f for f in fields(NormConfig) if "role" in f.metadata}
SUBLAYERS = {flag[2:].replace("-", "_") for flag in SUBLAYER_FLAGS}


def _get(cfg, name):
    value = setting_of(cfg, name)
    return _FIELDS[name].default if value is None and name in _FIELDS else value


def _side(cfg, name):
    """A sublayer's kind: its own flag, or its side's type."""
    return _get(cfg, name) or _get(cfg, "norm_type" if name.startswith("encoder") else "decoder_norm_type")


def _layer_scale(cfg, kinds):
    """The layer scale of each kind of the model that has one: --layer-scale if
    given, else on for pn (unless --no-pn-group-scaling), off for bn, rbn and pn-v."""
    given = _get(cfg, "layer_scale")
    default = {"bn": False, "rbn": False, "pn-v": False, "pn": _get(cfg, "pn_group_scaling") is not False}
    return ", ".join(f"{kind} {'on' if (default[kind] if given is None else given) else 'off'}"
                     for kind in sorted(kinds & set(default)))


def _of_sides(name, sides):
    """Whether a setting named for a side (encoder_..., decoder_...) is of one of the model's ``sides``."""
    side = name.split("_")[0]
    return side not in ("encoder", "decoder") or side in sides


def function_settings(cfg, sides=("encoder", "decoder")) -> dict:
    """{setting: value} of what a model of ``cfg`` (its flags: a namespace or a
    dict, a checkpoint's ``cfg.model``) computes with, for a model with
    ``sides``: each value as the model uses it (a sublayer's kind resolved to
    its side's, a norm's option only where a norm of that kind is in the
    model, the layer scale per kind), so that equal functions give equal settings."""
    resolved = {name: _side(cfg, name) if name in SUBLAYERS else _get(cfg, name) for name in _FIELDS}
    qk = resolved["qk_norm"] if resolved["qk_norm"] not in (None, "none") else "none"
    kinds = all_kinds(argparse.Namespace(**resolved), sides) | ({qk} - {"none"})
    out = {name: resolved[name] for name, f in _FIELDS.items()
           if f.metadata["role"] == FUNCTION and _of_sides(name, sides)
           and (f.metadata["kinds"] is None or kinds & set(f.metadata["kinds"]))}
    out["qk_norm"] = qk
    if qk == "none":
        del out["qk_norm_scope"]
    if resolved["norm_placement"] != "rezero":
        del out["rezero_gates"]
    if resolved["norm_placement"] != "mixln":
        del out["mixln_post_layers"]
    if "decoder" not in sides:
        out.pop("norm_causal", None)
    out.pop("pn_group_scaling", None)  # the pn-only spelling of the layer scale: compared as layer_scale
    if "layer_scale" in out:
        out["layer_scale"] = _layer_scale(cfg, kinds)
    if "norm_groups" in out:
        out["norm_groups"] = out["norm_groups"] or "the attention heads"
    for name in FAIRSEQ_FUNCTION:
        value = setting_of(cfg, name)
        if value is not None and _of_sides(name, sides):
            out[name] = value
    return out


def training_settings(cfg) -> dict:
    return {name: _get(cfg, name) for name, f in _FIELDS.items() if f.metadata["role"] != FUNCTION}


def flag(name) -> str:
    return "--" + name.replace("_", "-")


def differences(saved: dict, asked: dict) -> list:
    """(setting, checkpoint's value, asked value) for each setting that differs
    and is a setting of both models (an option of a norm kind only one of them
    has follows from the kinds, which differ)."""
    return [(k, saved[k], asked[k]) for k in saved if k in asked and saved[k] != asked[k]]


def describe(diff) -> str:
    name, saved, asked = diff
    return f"{flag(name)}: the checkpoint has {saved}, this asks {asked}"


def check_overrides(path, saved_cfg, overrides: dict, sides):
    """Refuse ``overrides`` (``--model-overrides``, a keyword of ``from_pretrained``)
    that would rebuild the checkpoint at ``path`` as a model with another function."""
    if not overrides:
        return
    merged = {**snapshot(saved_cfg), **overrides}
    diff = differences(function_settings(saved_cfg, sides), function_settings(merged, sides))
    if diff:
        raise PowerNormConfigError(f"{path}: an override would build another model than the checkpoint's "
                                   f"({describe(diff[0])}); leave that setting out of the overrides")


#: {id of a state dict read from a checkpoint: (a weak reference to it, the file, its model settings)}
_READ = {}


def remember(state_dict, path, saved_cfg):
    """Note the settings that ``state_dict``, read from ``path``, was trained
    with, for the model that loads it (:func:`check_load`)."""
    key = id(state_dict)
    try:
        ref = weakref.ref(state_dict, lambda _: _READ.pop(key, None))
    except TypeError:  # a plain dict (weak references need an OrderedDict, which torch saves)
        return
    _READ[key] = (ref, path, saved_cfg)


def recalled(state_dict):
    """(file, settings) noted for ``state_dict`` by :func:`remember`, or None."""
    entry = _READ.get(id(state_dict))
    return entry[1:] if entry is not None and entry[0]() is state_dict else None


def check_load(model, state_dict):
    """When ``model`` loads a state dict read from a checkpoint: refuse one
    whose function settings differ from the model's (unless the model was
    built with ``--allow-setting-changes``), and log the training settings
    that differ."""
    read, asked = recalled(state_dict), getattr(model, "built_with", None)
    if read is None or asked is None:
        return
    path, saved_cfg = read
    sides = tuple(model.NORM_FLAGS)
    diff = differences(function_settings(saved_cfg, sides), function_settings(asked, sides))
    if diff and not _get(asked, "allow_setting_changes"):
        raise PowerNormConfigError(
            f"{path}: trained as another model ({'; '.join(describe(d) for d in diff)}): pass the checkpoint's "
            f"settings, or {ALLOW} to fine-tune it into this model on purpose")
    for d in diff:
        logger.warning(f"{path}: {describe(d)} ({ALLOW}): the model computes another function from here on")
    for d in differences(training_settings(saved_cfg), training_settings(asked)):
        if d[0] == "allow_setting_changes":
            continue
        logger.info(f"{path}: {describe(d)}: a training setting, changed from here on")


def snapshot(cfg) -> dict:
    """A checkpoint's model flags as a plain dict, kept as they were read (overrides change the original)."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(cfg):
        return OmegaConf.to_container(cfg, resolve=True)
    return dict(cfg) if isinstance(cfg, dict) else dict(vars(cfg)) if cfg is not None else {}


def sides_of(arch) -> tuple:
    """The sides (encoder, decoder) a model of the plugin's architecture ``arch`` has."""
    from fairseq.models import ARCH_MODEL_REGISTRY

    model = ARCH_MODEL_REGISTRY.get(arch)
    return tuple(getattr(model, "NORM_FLAGS", ("encoder", "decoder")))


def on_read(path, state, overrides):
    """fairseq's checkpoint reader, for a checkpoint of the plugin: refuse
    overrides that change its function, and note its settings for the model
    that loads it."""
    saved = snapshot(model_config(state))
    check_overrides(path, saved, overrides, sides_of(saved.get("arch")))
    remember(state["model"], path, saved)


REBUILD_CHECKS.append(on_read)
