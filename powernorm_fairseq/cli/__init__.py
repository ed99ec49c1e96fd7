"""The console tools: powernorm-average, powernorm-score, powernorm-analyze, and the progress filter of the recipes."""
