"""``--qk-norm KIND``: each attention head's queries and keys normalised over
the head's channels before their scaled dot product, by a norm of any
per-token kind: LayerNorm's is ViT-22B's (Dehghani et al., 2023, Section 2.1),
RMSNorm's that of Wortsman et al. (2023). ``--qk-norm-scope projection``
normalises the whole query and key projections before the split into heads,
as OLMo 2 does (OLMo et al., 2024, Section 3.2).

Henry et al.'s QKNorm (2020, Eq. 2) is the nearest to ``--qk-norm scalenorm``:
l2-normalised queries and keys, and a learned scale in place of 1/sqrt(d).
Here fairseq keeps its 1/sqrt(d), and the two ScaleNorms' scales g_q g_k /
sqrt(d) are that one learned scale, but it starts at ScaleNorm's sqrt(d_head),
not at their g_0 from the sequence lengths.

The query and key projections of fairseq's ``MultiheadAttention`` become
:class:`HeadNormProjection`: the same linear layer (its ``weight`` and ``bias``
keep their names), then the norm over each head's slice of its output.
fairseq then computes the attention through those modules rather than
through ``F.multi_head_attention_forward``, which reads the weights alone.
"""

from torch import nn

from . import NORMS, build_norm

#: the kinds that normalise each head's vector by itself (batch statistics would share one scale
#: across heads, tokens and the batch; groupnorm's groups are a whole token's)
QK_KINDS = tuple(kind for kind, cls in NORMS.items() if not cls.running_stats and kind not in ("groupnorm", "none"))


#: what --qk-norm normalises: each head's slice, or the whole projection
QK_SCOPES = ("head", "projection")


def check_qk_norm(kind, scope="head"):
    """One line for a kind that cannot normalise a head's queries and keys (None and none: no such norm)."""
    if scope == "projection" and kind in (None, "none"):
        raise ValueError("--qk-norm-scope projection: the scope of --qk-norm, which is not given; add --qk-norm "
                         "KIND, or leave the flag out")
    if kind not in (None, "none", *QK_KINDS):
        raise ValueError(f"--qk-norm {kind}: the norm of each head's queries and keys must take one vector at a "
                         "time (batch statistics would mix heads, tokens and sentences); choose one of "
                         + ", ".join(QK_KINDS))


class HeadNormProjection(nn.Linear):
    """A query or key projection followed by ``norm`` over each of ``heads``
    slices of its output (a head's channels)."""

    def __init__(self, linear: nn.Linear, heads: int, norm: nn.Module):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None,
                         device=linear.weight.device, dtype=linear.weight.dtype)
        self.load_state_dict(linear.state_dict())
        self.heads, self.norm = heads, norm

    def forward(self, x):
        y = super().forward(x)
        rows = y.reshape(-1, 1, y.size(-1) // self.heads)  # a (token, head) per row; one vector each
        return self.norm.normalize(rows, None).reshape(y.shape)


def add_qk_norm_(attention, kind: str, options: dict, scope: str = "head"):
    """Normalise the queries and keys of fairseq ``attention`` with a norm of
    ``kind`` (constructor ``options``) per head, or (``scope`` projection)
    over the whole projection."""
    if kind == "none":
        return
    heads = attention.num_heads if scope == "head" else 1
    for name in ("q_proj", "k_proj"):
        norm = build_norm(kind, attention.embed_dim // heads, **options)
        setattr(attention, name, HeadNormProjection(getattr(attention, name), heads, norm))
    attention._set_skip_embed_dim_check()  # fairseq's own path, through q_proj and k_proj
