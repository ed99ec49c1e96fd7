# IWSLT14 PN with the backward pass of the authors' released code, to compare with their numbers
NORM=pn
EXTRA=(--pn-backward reference)
