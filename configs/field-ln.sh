# The field's norms since the paper on IWSLT14 (no paper numbers), LN row: the paper's setup with LN in encoder and decoder, pre-norm
NORM=ln
