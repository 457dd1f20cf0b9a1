"""Training: the LightningModule (`module.ASPOModule`), its forward passes, models and KL reference,
the FSDP2 strategy, precision, checkpoints (atomic saves, the run lock, resume checks), export and
the run's figures."""
