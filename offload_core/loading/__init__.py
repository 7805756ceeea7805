"""Loading: read checkpoints, build empty models, and dispatch a model's weights to devices and stores."""
