"""What a checkpoint holds: capture and restore of training state, the JSON codec,
RNG sources and the run contract."""
