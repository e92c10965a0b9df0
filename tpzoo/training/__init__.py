"""What the training scripts are made of: the shared flags, the learning-rate schedule, logging and
the loop around ``tpzoo.engine.Engine``."""
