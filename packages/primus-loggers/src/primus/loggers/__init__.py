"""Primus run loggers as plugins: Weights & Biases (``wandb_logger``) and MLflow (``mlflow_logger``)."""

__version__ = "0.1.0"
