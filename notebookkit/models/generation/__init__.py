"""Fast generation: the decode path behind ``FastLanguageModel.for_inference``."""
