"""diffring workers: pull loops of the encoder, transformer and decoder stages."""
