"""Training: the loop (:mod:`.loop`), what a batch means for each model (:mod:`.tasks`),
and the pieces the loop calls: evaluation and the best model (:mod:`.evaluation`), a run's
checkpoints (:mod:`.run_state`), its length and time budget (:mod:`.budget`), stop requests
(:mod:`.signals`) and what a run shows as it goes (:mod:`.progress`).

    from npformer.train import Trainer, TrainConfig, LanguageModeling
"""
from ..data.batching import EpochBatches
from .config import History, TrainConfig
from .loop import Trainer, TrainingDiverged, TrainingInterrupted
from .tasks import Classification, LanguageModeling, Task, Translation, accuracy, perplexity

__all__ = ["Classification", "EpochBatches", "History", "LanguageModeling", "Task",
           "TrainConfig", "Trainer", "TrainingDiverged", "TrainingInterrupted", "Translation",
           "accuracy", "perplexity"]
