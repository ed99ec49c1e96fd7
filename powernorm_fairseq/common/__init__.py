"""What the models, the patches and the console tools share: errors, checkpoint reading, files, flags."""
