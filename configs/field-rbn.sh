# The field's norms since the paper on IWSLT14, Regularized BN row (arXiv 2210.05153): RBN in the encoder with its authors' pre-norm weights (0.1, 0.01) and momentum 0.05, LN in the decoder, pre-norm
NORM=rbn
