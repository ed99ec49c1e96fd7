"""What every norm shares: the forward signature and the padding mask.

Every norm takes, in the same call:

* ``x`` of shape ``(seq_len, batch, channels)`` and fairseq's padding mask
  ``pad_mask`` of shape ``(batch, seq_len)``, True at padding;
* ``x`` of shape ``(batch, seq_len, channels)`` with ``batch_first=True``;
* ``attention_mask=`` instead of ``pad_mask``: HuggingFace's convention,
  (batch, seq_len), 1 or True at real tokens, in either layout;
* ``x`` of shape ``(tokens, channels)``, every row a real token, no mask.

``attention_mask=`` means HuggingFace's (batch, seq_len, channels) layout
unless ``batch_first=False`` says otherwise; with neither layout given, an
``x`` whose first two sizes are equal could be read either way, and is refused.
A mask that is not bool must hold only 0 and 1 (checked: in eager mode by one
read on the host, under torch.compile and torch.export on the device);
anything else is refused in one line, never guessed at. fairseq's layers call
their norms with ``x`` alone, so the encoder and decoder of this plugin hand
the mask over with :func:`padding_mask` for a forward.
"""

import logging
from contextlib import contextmanager
from typing import NamedTuple, Optional

import torch
from torch import Tensor, nn

logger = logging.getLogger(__name__)


class Flag(NamedTuple):
    """A command-line flag that belongs to one norm kind (``Norm.flags``): the
    models make it a field of their flags (``models/options.py``, NormConfig)."""

    default: object
    help: str
    role: str  # "function": part of what the model computes; "training": how it is trained (models/settings.py)
    argparse: dict  # how argparse reads it: type=, metavar=, choices=, action=


class Norm(nn.Module):
    """Base class: ``forward(x, pad_mask=None)`` over ``(T, B, C)``.

    What the rest of the plugin needs to know of a norm, each class declares:
    :meth:`options` (its constructor options from the model's flags),
    ``flags`` (the flags of its own, which only it reads), ``running_stats``
    (whether it keeps running statistics of the batch) and, for those,
    :meth:`diagnostics_view` (what ``--norm-diagnostics`` measures).
    """

    #: set by :func:`padding_mask` for calls that cannot pass the mask, with its layout
    pad_mask: Optional[Tensor] = None
    mask_batch_first: bool = False
    #: keeps running statistics of its training batches (eval uses them)
    running_stats = False
    #: its own flags, by field name (``--kind-option`` as ``kind_option``), which :meth:`options` reads
    flags: dict = {}
    #: set by the models for a norm inside a causal decoder (see :meth:`warn_leak`)
    in_causal_decoder = False
    #: the name of its affine gain, for a kind that has one (a learned length is "scale")
    GAIN = "weight"
    #: what every read of the gain adds to the stored one: 0, or with ``unit_offset`` the gain at
    #: initialisation (:meth:`offset_gain`)
    w_offset = 0.0

    @classmethod
    def options(cls, cfg, heads: int, final: bool = False) -> dict:
        """Constructor options from the model's flags ``cfg``; ``heads``: the
        attention heads of its side; ``final``: the norm after the last layer."""
        return {}

    def diagnostics_view(self, x: Tensor, pad_mask: Optional[Tensor]):
        """For a norm with running statistics: ``(stats, (xs, mean, inv))``,
        the batch and running statistics by name and what gives x-hat, as the
        coming training forward will compute them (see ``diagnostics``)."""
        raise NotImplementedError

    def forward(self, x: Tensor, pad_mask: Optional[Tensor] = None, *, batch_first: Optional[bool] = None,
                attention_mask: Optional[Tensor] = None) -> Tensor:
        """x: (T, B, C), or (B, T, C) with ``batch_first``, or (N, C) tokens;
        ``pad_mask`` (B, T) True at padding, or ``attention_mask`` (B, T) 1 at
        real tokens. ``batch_first`` defaults to False, and to True with
        ``attention_mask``. Returns y in x's layout."""
        if attention_mask is not None:
            if pad_mask is not None:
                raise ValueError("pass pad_mask (True at padding) or attention_mask (1 at real tokens), not both")
            if batch_first is None:
                if x.dim() == 3 and x.size(0) == x.size(1):
                    raise ValueError(
                        f"x of shape {tuple(x.shape)} with attention_mask and no layout: its first two sizes are "
                        "equal, so it could be (batch, seq_len, channels) or (seq_len, batch, channels); pass "
                        "batch_first=True (HuggingFace's layout) or batch_first=False")
                batch_first = True
            pad_mask, name = ~as_bool_mask(attention_mask, "attention_mask"), "attention_mask"
        elif pad_mask is None and self.pad_mask is not None:
            pad_mask, name = self.pad_mask, "pad_mask"
            batch_first = self.mask_batch_first if batch_first is None else batch_first
        else:  # a bool mask as it is, without a call (a small layer's step is host time: measure/host.py)
            if pad_mask is not None and pad_mask.dtype is not torch.bool:
                pad_mask = as_bool_mask(pad_mask, "pad_mask")
            name = "pad_mask"
        batch_first = bool(batch_first)
        if x.ndim == 2:  # (N, C): every row a token
            if pad_mask is not None:
                raise ValueError(f"x of shape {tuple(x.shape)} is (tokens, channels) and takes no {name}; "
                                 "pass only the real tokens, or x as (T, B, C) / (B, T, C) with the mask")
            return self.normalize(x.unsqueeze(1), None).squeeze(1)
        if x.ndim != 3:
            raise ValueError(f"x has shape {tuple(x.shape)}: expected (seq_len, batch, channels), "
                             "(batch, seq_len, channels) with batch_first=True, or (tokens, channels)")
        xt = x.transpose(0, 1) if batch_first else x  # (T, B, C)
        if pad_mask is not None and pad_mask.shape != (xt.shape[1], xt.shape[0]):
            layout = "(batch, seq_len, channels) with batch_first=True" if batch_first else "(seq_len, batch, channels)"
            raise ValueError(
                f"{name} has shape {tuple(pad_mask.shape)}, expected (batch, seq_len) = "
                f"({xt.size(1)}, {xt.size(0)}) for x of shape {tuple(x.shape)} read as {layout}"
            )
        y = self.normalize(xt, pad_mask)
        return y.transpose(0, 1) if batch_first else y

    def normalize(self, x: Tensor, pad_mask: Optional[Tensor]) -> Tensor:
        raise NotImplementedError

    def reset_parameters(self) -> None:
        """Gain 1 (:meth:`initial_gain`) and bias 0, as ``nn.LayerNorm`` and ``nn.BatchNorm1d`` start (a
        unit-offset gain: 0)."""
        with torch.no_grad():
            for name, p in self.named_parameters(recurse=False):
                p.fill_(0.0 if name == "bias" else self.initial_gain() - self.w_offset)

    def initial_gain(self) -> float:
        """The gain at initialisation: 1 (a learned length's: sqrt(C))."""
        return 1.0

    def offset_gain(self, unit_offset: bool) -> None:
        """``unit_offset``: the gain is stored as its offset from the initial one (gamma - 1; a learned length
        g: g - sqrt(C)), initialised at 0 and read as w_offset + gamma wherever it is read (the kernels'
        ``w_offset``), so that weight decay pulls it toward the identity (x-transformers'
        ``norm_add_unit_offset``, Gemma's norms, TransformerEngine's ``zero_centered_gamma``)."""
        self.w_offset = self.initial_gain() if unit_offset else 0.0
        if unit_offset:
            with torch.no_grad():
                self._parameters[self.GAIN].sub_(self.w_offset)

    @property
    def unit_offset(self) -> bool:
        """Whether the gain is stored as its offset from the initial one (every initial gain is non-zero)."""
        return self.w_offset != 0.0

    def gain(self, like: Tensor) -> Tensor:
        """The gain as the norm applies it, in like's dtype: the stored one plus ``w_offset``."""
        g = self._parameters[self.GAIN].to(like)
        return g + self.w_offset if self.w_offset else g

    def offset_repr(self) -> str:
        return ", unit_offset=True" if self.unit_offset else ""

    def reset_running_stats(self) -> None:
        """The running statistics as at construction (a norm without them has nothing to reset)."""

    _warned = set()

    def warn_leak(self, kind: str):
        """Once per process and kind: batch statistics in a causal decoder let
        each token see the later tokens of the batch while training."""
        if self.in_causal_decoder and kind not in Norm._warned and not torch.compiler.is_compiling():
            Norm._warned.add(kind)
            logger.warning("powernorm_fairseq: %s in a causal decoder normalises each training token with "
                           "statistics of the whole batch, later tokens included (a leak of the future that "
                           "generation does not have); --norm-causal uses running statistics instead", kind)

    #: attributes a step or a wrapper sets that change no setting (``__setattr__`` keeps the configuration)
    _SCRATCH = frozenset(("_given", "training", "pad_mask", "mask_batch_first"))

    def step_config(self):
        """The fused norms' step configuration (kernels/functions.py's ChannelConfig, ``make_step_config``),
        made once and made again where a setting was set since (``__setattr__`` drops it) or a buffer is
        not one it holds: replaced by ``.to()`` or a cast, a load with ``assign``, a buffer registered,
        torch.func.functional_call's swap of an entry of ``_buffers``."""
        config, bufs = self.__dict__.get("_config"), self._buffers
        if config is not None and len(bufs) == len(config.held):
            for now, held in zip(bufs.values(), config.held):
                if now is not held:
                    break
            else:
                return config
        config = self.__dict__["_config"] = self.make_step_config()
        config.held = tuple(bufs.values())
        return config

    def make_step_config(self):
        raise NotImplementedError

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name not in Norm._SCRATCH:
            self.__dict__.pop("_config", None)

    def __getstate__(self):  # a copy or a pickle makes its own configuration (it holds this one's buffers)
        state = dict(super().__getstate__())
        state.pop("_config", None)
        return state

    def _apply(self, fn, recurse=True):
        # Running statistics stay float32 when the model is cast to float16
        # or bfloat16 (fairseq's --fp16 / --bf16 call .half() / .to(bfloat16)):
        # half precision would round away the small updates of a running
        # average and overflow psi^2. Casts to float64 and moves between
        # devices apply as usual.
        kept = {name: buf.dtype for name, buf in self._buffers.items()
                if buf is not None and buf.dtype == torch.float32}
        super()._apply(fn, recurse)
        for name, dtype in kept.items():
            buf = self._buffers[name]
            if buf.dtype in (torch.float16, torch.bfloat16):
                self._buffers[name] = buf.to(dtype)
        return self


def as_bool_mask(mask: Tensor, name: str) -> Tensor:
    """``mask`` as bool: bool as it is, another dtype only if it holds just 0 and 1.

    ``~`` on an integer mask flips its bits rather than its truth, and a float
    mask may be an additive one (0 and -inf): either would be misread. In
    eager mode the check reads the host once; compiled or exported, it runs
    on the device (``torch._assert_async``), so the graph does not break."""
    if mask.dtype == torch.bool:
        return mask
    dtype = str(mask.dtype).replace("torch.", "")
    if mask.is_complex():
        raise ValueError(f"{name} of dtype {dtype}: pass a bool mask, or 0/1")
    binary = ((mask == 0) | (mask == 1)).all()
    if torch.compiler.is_compiling():
        torch._assert_async(binary, f"{name} of dtype {dtype} holds values other than 0 and 1: pass a bool "
                                    "mask, or 0/1 (an additive mask is not one)")
    elif not binary:
        values = mask.unique()[:4].tolist()
        raise ValueError(f"{name} of dtype {dtype} holds values other than "
                         f"0 and 1 (e.g. {values}): pass a bool mask, or 0/1 (an additive mask is not one)")
    return mask != 0


def recomputing() -> bool:
    """Whether this forward runs inside a backward pass: activation
    checkpointing's recomputation (``torch.utils.checkpoint``, reentrant or
    not, and the wrappers built on it), which must give the first forward's
    output again and leave the running statistics alone. Under torch.compile
    a checkpointed region is recomputed in the compiled backward, never here."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def momentum_option(cfg) -> dict:
    """``--norm-momentum`` if given: without it each class keeps its own default."""
    return {} if cfg.norm_momentum is None else dict(momentum=cfg.norm_momentum)


def layer_scale_option(cfg, default: bool) -> bool:
    """``--layer-scale``/``--no-layer-scale`` if given, else the kind's ``default``."""
    return default if getattr(cfg, "layer_scale", None) is None else cfg.layer_scale


class NoNorm(Norm):
    """``none``: the identity, for "w/o Norm" ablations."""

    def __init__(self, dim: int, device=None, dtype=None):
        super().__init__()
        self.dim = dim

    def normalize(self, x: Tensor, pad_mask: Optional[Tensor]) -> Tensor:
        return x

    def extra_repr(self) -> str:
        return f"{self.dim}"


@contextmanager
def padding_mask(module: nn.Module, pad_mask: Optional[Tensor] = None, *, batch_first: bool = False,
                 attention_mask: Optional[Tensor] = None):
    """Give every :class:`Norm` inside ``module`` the mask for calls with ``x``
    alone: fairseq's ``pad_mask`` (B, T), True at padding, or HuggingFace's
    ``attention_mask`` (B, T), 1 at real tokens; ``batch_first``: the norms
    see (B, T, C) inputs (HuggingFace's models), else (T, B, C). Yields
    those norms."""
    if attention_mask is not None:
        if pad_mask is not None:
            raise ValueError("pass pad_mask (True at padding) or attention_mask (1 at real tokens), not both")
        pad_mask = ~as_bool_mask(attention_mask, "attention_mask")
    elif pad_mask is not None:
        pad_mask = as_bool_mask(pad_mask, "pad_mask")
    norms = [m for m in module.modules() if isinstance(m, Norm)]
    for norm in norms:
        norm.pad_mask, norm.mask_batch_first = pad_mask, batch_first
    try:
        yield norms
    finally:
        for norm in norms:
            norm.pad_mask, norm.mask_batch_first = None, False

