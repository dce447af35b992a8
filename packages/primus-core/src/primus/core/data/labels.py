"""The label a position carries when its next token is not trained (fine-tuning's context, padding)."""

IGNORE_INDEX = -100  # the label both engines skip (torch's cross_entropy default)
