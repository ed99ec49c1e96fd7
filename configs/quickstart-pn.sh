# Quickstart, PN row: the CPU-sized IWSLT14 small on the shipped corpus, PN encoder and LN decoder
DATASET=quickstart
NORM=pn
