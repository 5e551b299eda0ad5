"""DSpark: a parallel drafter on the target's own features (DeepSeek, 2026; DeepSpec's layout).

- config.py: a DSpark checkpoint's settings (DeepSpec's ``config.json``), checked against a target;
- modeling.py: the backbone, the Markov head and the confidence head (DeepSpec's parameter names);
- checkpoint.py: load and save a checkpoint directory in DeepSpec's layout;
- drafter.py: the `dspark` drafter the decoders run;
- training.py: training on a frozen target within a time budget, resumable, and its report;
  training_forward.py: the many-blocks training forward and the loss; calibration.py: the
  confidence head's per-position temperatures; sequences.py: the target's own text to train on.
"""

from inference.engine.drafters.dspark.checkpoint import DSparkLoadError, load_dspark, save_dspark
from inference.engine.drafters.dspark.config import DSparkConfig
from inference.engine.drafters.dspark.drafter import DSparkDrafter
from inference.engine.drafters.dspark.modeling import DSparkModel

__all__ = ["DSparkConfig", "DSparkDrafter", "DSparkLoadError", "DSparkModel", "load_dspark", "save_dspark"]
