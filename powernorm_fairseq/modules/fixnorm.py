"""FixNorm (Nguyen & Chiang, 2018; as used by Nguyen & Salazar, 2019,
"Transformers without Tears", https://arxiv.org/abs/1910.05895, Section 2.3):
every word embedding is scaled to unit length and multiplied by one learned
length ``g``, initialised to ``sqrt(d)``. The embeddings start at
U(-0.01, 0.01) since only their direction matters.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class FixNormEmbedding(nn.Embedding):
    """An embedding table whose rows are used as ``g * e / ||e||``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int):
        super().__init__(num_embeddings, embedding_dim, padding_idx=padding_idx)
        nn.init.uniform_(self.weight, -0.01, 0.01)
        with torch.no_grad():
            self.weight[padding_idx].zero_()
        self.scale = nn.Parameter(torch.tensor(math.sqrt(embedding_dim)))

    def fixnorm_weight(self) -> Tensor:
        """The (V, d) table as the model uses it; the pad row stays zero."""
        return self.scale * F.normalize(self.weight, dim=-1)

    def forward(self, tokens: Tensor) -> Tensor:
        return F.embedding(tokens, self.fixnorm_weight(), self.padding_idx)
