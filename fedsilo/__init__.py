"""fedsilo: cross-silo federated learning for NLP."""
__version__ = "0.1.0"
