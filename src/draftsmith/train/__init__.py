"""Training-time-test training of EAGLE-3 drafters (offline from a dataset, or online)."""

from draftsmith.train.loop import TrainConfig, train

__all__ = ["TrainConfig", "train"]
