# The field's norms since the paper on IWSLT14, Mix-LN row (arXiv 2412.13795): LN, post-norm in the first quarter of each side's layers (1 of 6), pre-norm after
NORM=ln
PLACEMENT=mixln
