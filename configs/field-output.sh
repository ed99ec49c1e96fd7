# The field's norms since the paper on IWSLT14, output-norm row (OLMo 2, arXiv 2501.00656): LN on each sublayer's output, none on its input
NORM=ln
PLACEMENT=output
