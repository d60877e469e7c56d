"""Per-rank training: models, distributed set-up, DDP/DeepSpeed engines, the train loop and checkpoints."""
