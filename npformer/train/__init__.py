"""Training: the loop (:mod:`.loop`), what a batch means for each model (:mod:`.tasks`),
and what a run shows as it goes (:mod:`.progress`).

    from npformer.train import Trainer, TrainConfig, LanguageModeling
"""
from .loop import (
    EpochBatches,
    History,
    TrainConfig,
    Trainer,
    TrainingDiverged,
    TrainingInterrupted,
    accuracy,
    perplexity,
)
from .tasks import Classification, LanguageModeling, Task, Translation

__all__ = ["Classification", "EpochBatches", "History", "LanguageModeling", "Task",
           "TrainConfig", "Trainer", "TrainingDiverged", "TrainingInterrupted", "Translation",
           "accuracy", "perplexity"]
